"""benchmarks/bench_fp8.py on the CPU: the tile rule it times ('auto' = fp8_gemm.choose_tile)
and its interleaved timing loop, with stand-in functions (the FP8 kernels need a Hopper GPU;
the real run is benchmarks/results/fp8_gemm_runs.md)."""

import argparse

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_fp8
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
