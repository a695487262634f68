"""benchmarks/bench_fp8.py on the CPU: the tile rule it times ('auto' = fp8_gemm.choose_tile)
and its interleaved timing loop, with stand-in functions (the FP8 kernels need a Hopper GPU;
the real run is benchmarks/results/fp8_gemm_runs.md)."""

import argparse
import time

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_fp8
from benchmarks.timing import time_paired
from moe_praxis.ops import fp8_gemm


@pytest.mark.parametrize("rows,groups,want", [(65536, 128, fp8_gemm.TILE_FEW_ROWS),
                                              (65537, 128, fp8_gemm.TILE_MANY_ROWS),
                                              (32768, 8, fp8_gemm.TILE_MANY_ROWS),
                                              (0, 8, fp8_gemm.TILE_FEW_ROWS)])
def test_choose_tile_rule_and_tiles_are_overlapped_cooperative(rows, groups, want):
    tile = fp8_gemm.choose_tile(rows, groups)
    assert tile == want
    assert fp8_gemm.TILE_CONFIGS[tile].startswith("coop_128x128x128_")
    assert fp8_gemm.TILE_CONFIGS[tile].endswith("_overlap")


def _fake(monkeypatch, calls):
    """bench_fp8.run over one small shape with two stand-in GEMMs and one that raises."""
    monkeypatch.setattr(bench_fp8, "SHAPES", {"A": (2, 256, 128, 128)})

    def make_fns(op, m, k, n, e, dense_f32=False, tiles=(0, )):
        calls.append(tiles)
        bad = lambda d: (_ for _ in ()).throw(RuntimeError("kernel failed"))  # noqa: E731
        return "cfg", {
            "bf16": jax.jit(lambda d: d["lhs"] @ d["w"]),
            "fp8": jax.jit(lambda d: (d["lhs"] @ d["w"]) * 1.01),
            "fp8[x]": bad,
        }

    monkeypatch.setattr(bench_fp8, "make_fns", make_fns)
    monkeypatch.setattr(bench_fp8, "prepare", lambda e, m, k, n, dist: {
        "lhs": jnp.ones((m, k)),
        "w": jnp.ones((k, n))
    })
    monkeypatch.setattr(bench_fp8, "MIN_SAMPLE_S", 0.001)
    monkeypatch.setattr(bench_fp8, "SPIN_UP_S", 0.0)
    return argparse.Namespace(shapes=["A"],
                              dists=["balanced"],
                              ops=["fwd", "wgrad"],
                              tiles=("auto", 2),
                              dense_f32=False,
                              warmup=1,
                              reps=3,
                              time_budget=100.0)


def test_run_times_every_row_and_reports_failures(monkeypatch):
    calls = []
    args = _fake(monkeypatch, calls)
    rows = bench_fp8.run(args)
    assert calls == [(fp8_gemm.choose_tile(256, 2), 2)] * 2  # 'auto' resolved per point
    by = {(r["op"], r["name"]): r for r in rows}
    assert len(rows) == 6
    for op in ("fwd", "wgrad"):
        assert by[(op, "bf16")]["ms"] > 0 and by[(op, "fp8")]["ms"] > 0
        assert by[(op, "fp8")]["rel_err_vs_bf16"] == pytest.approx(0.01, rel=1e-3)
        assert by[(op, "fp8")]["speedup_vs_bf16"] > 0
        assert by[(op, "fp8")]["target"] == bench_fp8.TARGETS[(op, "A")]
        assert "kernel failed" in by[(op, "fp8[x]")]["error"]
    print(bench_fp8.table(rows))


def test_spent_budget_skips_points(monkeypatch):
    args = _fake(monkeypatch, [])
    args.time_budget = -1.0
    rows = bench_fp8.run(args)
    assert rows and all("skipped" in r and "ms" not in r for r in rows)


def test_time_paired_batches_reach_min_sample_and_spin_up_runs_first():
    """The shared interleaved timer (benchmarks.timing.time_paired) with the FP8
    benchmark's options: each batch at least min_sample_s of calls, the spin-up before."""
    calls = {"a": 0, "b": 0}

    def fn(name, secs):

        def f():
            calls[name] += 1
            time.sleep(secs)
            return 0.0

        return f

    t0 = time.perf_counter()
    secs = time_paired({
        "a": fn("a", 0.002),
        "b": fn("b", 0.004)
    },
                       target_s=0.0,
                       reps=3,
                       min_sample_s=0.02,
                       spin_up_s=0.05)
    assert time.perf_counter() - t0 >= 0.05 + 3 * 2 * 0.02
    assert 0.002 <= secs["a"] < 0.004 <= secs["b"] < 0.008, secs
    # 2 calls to size the batch, >= 0.05 / 0.002 spin-up calls, 3 rounds of >= 0.02 / 0.002
    assert calls["a"] >= 2 + 10 + 3 * 10 and 2 + 3 * 5 <= calls["b"] < 2 + 10 + 3 * 10, calls
