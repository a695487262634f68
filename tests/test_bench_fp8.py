"""benchmarks/bench_fp8.py on the CPU: the tile rule it times ('auto' = fp8_gemm.choose_tile)
and its interleaved timing loop, with stand-in functions (the FP8 kernels need a Hopper GPU;
the real run is benchmarks/results/fp8_gemm_runs.md)."""

import argparse
import itertools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_fp8, timing
from benchmarks.timing import time_paired
from moe_praxis.ops.fp8 import gemm as fp8_gemm


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


class _FakeClock:
    """time.perf_counter for benchmarks.timing, advanced only by the stand-in calls, so the
    test checks the timer's batching and not this machine's scheduling (a real sleep on a
    loaded CI machine overshoots and made the batch sizes vary)."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


def test_time_paired_batches_reach_min_sample_and_spin_up_runs_first(monkeypatch):
    """The shared interleaved timer (benchmarks.timing.time_paired) with the FP8
    benchmark's options: each batch at least min_sample_s of calls, the spin-up before."""
    clock = _FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    order = []

    def fn(name, secs):

        def f():
            order.append(name)
            clock.now += secs
            return 0.0

        return f

    secs = time_paired({
        "a": fn("a", 0.002),
        "b": fn("b", 0.004)
    },
                       target_s=0.0,
                       reps=3,
                       min_sample_s=0.02,
                       spin_up_s=0.05)
    assert secs["a"] == pytest.approx(0.002) and secs["b"] == pytest.approx(0.004), secs
    # 2 calls each to size the batch; then the spin-up's calls of a run into round 1's batch
    assert order[:4] == ["a", "a", "b", "b"]
    runs = [(name, len(list(group))) for name, group in itertools.groupby(order[4:])]
    assert [name for name, _ in runs] == ["a", "b"] * 3, runs
    batch_a, batch_b = runs[2][1], runs[1][1]
    assert batch_a in (10, 11) and batch_b in (5, 6), runs  # ceil(0.02 / t), float rounding
    assert runs[0][1] - batch_a in (25, 26), runs  # spin-up: 0.05 s of a
    spun_and_first = runs[0][1]
    want = [("a", spun_and_first)] + [("b", batch_b), ("a", batch_a)] * 2 + [("b", batch_b)]
    assert runs == want, runs
    assert clock.now - 1000.0 >= 0.05 + 3 * (0.02 + 0.02)
