"""The sm_80 grouped GEMM's tiles and the rule that picks one, on the CPU: the wave-count rule
and the measured rankings (SM80_MEASURED) with the examples of docs/grouped_gemm_sm80.md, the
tiles against kernels/grouped_gemm_sm80.cuh, configurations of the other family as errors, both
families' FFI checks from the shared header, the workspace size, the sm_80 gencodes of the
kernels, and the benchmark's sm_80 summary and tile sweep."""

import importlib
import re

import jax.numpy as jnp
import pytest

from benchmarks import sm80_sweep
from benchmarks.grouped_gemm_cases import SHAPES as BENCH_SHAPES
from benchmarks.grouped_gemm_cases import parse_sm80_tiles
from benchmarks.grouped_gemm_report import sm80_summary
from moe_praxis import build_kernels, ops
from moe_praxis.ops import backend
from tests.grouped_gemm_util import REPO, _fake_device, _inputs, gg
from tests.testutil import seed as _seed

SHAPES = {  # the grouped GEMM benchmark's A, B, C: (E, M, K, N)
    "A": (8, 32768, 4096, 14336),
    "B": (32, 32768, 7168, 2048),
    "C": (128, 65536, 2048, 768),
}


def test_rule_examples_of_the_docs(monkeypatch):
    """The wave-count rule (no measured shape within reach: SM80_MEASURED emptied here) and the
    examples the docs give of it."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    monkeypatch.setattr(importlib.import_module("moe_praxis.ops.grouped_gemm_sm80"),
                        "SM80_MEASURED", {})
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            assert gg.choose_sm80_config(op, m, k, n, e) == "sm80_128x256x64_s3", (op, m, k, n, e)
    assert gg.choose_sm80_config("fwd", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert gg.choose_sm80_config("dgrad", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert gg.choose_sm80_config("wgrad", 16384, 2048, 768, 128) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", 8192, 64, 64, 8) == "sm80_128x64x32_s4"
    assert gg.choose_sm80_config("fwd", 8192, 1024, 512, 8) == "sm80_128x128x32_s4"
    doc = (REPO / "docs" / "grouped_gemm_sm80.md").read_text()
    for name in gg.SM80_TILE_CONFIGS:
        assert f"`{name}`" in doc, f"docs/grouped_gemm_sm80.md does not describe {name}"
    flat = " ".join(doc.split())
    assert "`choose_sm80_config('fwd', 8192, 64, 64, 8)` -> `sm80_128x64x32_s4`" in flat
    assert "`choose_sm80_config('fwd', 16384, 2048, 768, 128)` -> `sm80_64x128x32_s4`" in flat
    with pytest.raises(ValueError, match="op='up' is invalid"):
        gg.choose_sm80_config("up", 8, 8, 8, 1)
    # the 128x256 tile needs 144 KiB of shared memory: on sm_86 / sm_89 (99 KiB) the rule
    # takes 128x128; the shared memory of each tile is its mainloop's stages of A and B
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            assert gg.choose_sm80_config(op, m, k, n, e, 99 * 1024) == "sm80_128x128x32_s4"
            assert gg.choose_sm80_config(op, m, k, n, e, 227 * 1024) == "sm80_128x256x64_s3"
    assert [gg.sm80_shared_memory(c) // 1024
            for c in gg.SM80_TILE_CONFIGS] == [144, 64, 48, 48, 144, 96, 96, 96, 80, 80]
    assert "on an sm_86 GPU (99 KiB per block) A, B and C take `sm80_128x128x32_s4`" in flat


def test_rule_takes_the_nearest_measured_shape_and_its_fastest_tile_that_fits(monkeypatch):
    """SM80_MEASURED (the sweep's per-shape rankings) decides near a measured shape: the nearest
    one's fastest tile whose shared memory fits the GPU; beyond MEASURED_REACH in any per-group
    dimension, and for groups of at most 128 rows, the wave-count rule decides as before."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    sm80 = importlib.import_module("moe_praxis.ops.grouped_gemm_sm80")
    e, m, k, n = SHAPES["B"]
    ranking_b = ("sm80_256x128x64_s3", "sm80_128x256x32_s4", "sm80_128x128x32_s4")
    ranking_c = ("sm80_128x128x64_s3", "sm80_64x256x32_s4")
    monkeypatch.setattr(sm80, "SM80_MEASURED",
                        {"fwd": ((SHAPES["B"], ranking_b), (SHAPES["C"], ranking_c))})
    assert gg.choose_sm80_config("fwd", m, k, n, e) == "sm80_256x128x64_s3"
    # 144 KiB does not fit 99 KiB: the next measured tile
    assert gg.choose_sm80_config("fwd", m, k, n, e, 99 * 1024) == "sm80_128x256x32_s4"
    # per group 2x the rows and half the width of B: still nearest B
    assert gg.choose_sm80_config("fwd", 2 * m, k, n // 2, e) == "sm80_256x128x64_s3"
    # C's neighbourhood (per group 512 rows, N = 768, K = 2048)
    assert gg.choose_sm80_config("fwd", 65536, 2048, 1024, 128) == "sm80_128x128x64_s3"
    # dgrad has no measured shapes; K 8x beyond reach: the wave-count rule
    assert gg.choose_sm80_config("dgrad", m, k, n, e) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", m, 8 * k, n, e) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert sm80.measured_ranking("fwd", m, k, n, e) == ranking_b
    assert sm80.measured_ranking("wgrad", m, k, n, e) is None
    assert sm80.sm80_problem("wgrad", 1024, 64, 32, 8) == (64, 32, 128)


def test_measured_rankings_are_whole_and_the_rule_takes_them_at_the_benchmark_shapes(monkeypatch):
    """SM80_MEASURED (the sweep's rankings, pasted from the benchmark): per op the three
    benchmark shapes, each ranking every tile once; at A, B and C the rule takes the measured
    winners (128x256x32 for fwd and wgrad, 256x128x32 for dgrad, both 96 KiB: the same on a
    99 KiB GPU), as docs/grouped_gemm_sm80.md says."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    sm80 = importlib.import_module("moe_praxis.ops.grouped_gemm_sm80")
    assert set(sm80.SM80_MEASURED) == set(gg.OPS)
    for op, entries in sm80.SM80_MEASURED.items():
        assert sorted(shape for shape, _ in entries) == sorted(SHAPES.values()), op
        for shape, ranking in entries:
            assert sorted(ranking) == sorted(gg.SM80_TILE_CONFIGS), (op, shape)
    want = {
        "fwd": "sm80_128x256x32_s4",
        "dgrad": "sm80_256x128x32_s4",
        "wgrad": "sm80_128x256x32_s4"
    }
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            for smem in (None, 99 * 1024, 227 * 1024):
                assert gg.choose_sm80_config(op, m, k, n, e, smem) == want[op], (op, e, smem)
    flat = " ".join((REPO / "docs" / "grouped_gemm_sm80.md").read_text().split())
    assert ("`choose_sm80_config` gives `sm80_128x256x32_s4` for fwd and wgrad and "
            "`sm80_256x128x32_s4` for dgrad at A, B and C (measured)") in flat


def test_tiles_match_the_kernel_header():
    """SM80_TILE_CONFIGS (index = the `tile` attribute) names the header's tiles in the order of
    its dispatch: threadblock shape and stages of each Tile<...> alias."""
    header = (REPO / "kernels" / "grouped_gemm_sm80.cuh").read_text()
    aliases = {
        alias: tuple(int(v) for v in dims)
        for alias, *dims in re.findall(
            r"using (Tile\w+) = Tile<(\d+), (\d+), (\d+), \d+, \d+, \d+, (\d+)>", header)
    }
    assert len(aliases) == len(gg.SM80_TILE_CONFIGS), aliases
    cases = re.findall(
        r"case (\d+):\s*return run_grouped<GemmDef<Element, LayoutA, LayoutB, "
        r"(Tile\w+)>", header)
    assert [int(i) for i, _ in cases] == list(range(len(gg.SM80_TILE_CONFIGS)))
    for (i, alias), name in zip(cases, gg.SM80_TILE_CONFIGS):
        assert aliases[alias] == gg.sm80_tile_shape(name), (i, alias, name)
    assert f"kNumTiles = {len(gg.SM80_TILE_CONFIGS)}" in header


def test_configs_of_the_other_family_are_errors(monkeypatch):
    """A forced configuration must belong to the family that runs: an sm_80 name on a Hopper
    GPU, a Hopper name on an A100, or a bad sm_80 name, is an error naming the valid ones."""
    lhs, rhs, gs, _ = _inputs(32, 16, 16, 2, "balanced", jnp.bfloat16, _seed())
    with pytest.raises(ValueError, match=r"config 'sm80_1x1x1_s1' is invalid; valid: \('sm80_"):
        ops.grouped_gemm(lhs, rhs, gs, config="sm80_1x1x1_s1")
    _fake_device(monkeypatch, 80)
    with pytest.raises(ValueError, match=r"not a configuration of the sm80 kernels.*'sm80_128x256"):
        ops.grouped_gemm(lhs, rhs, gs, backend="cuda", config="coop_128x256_c2x1")
    _fake_device(monkeypatch, 90)
    with pytest.raises(ValueError, match=r"not a configuration of the sm90 kernels"):
        ops.grouped_gemm(lhs, rhs, gs, backend="cuda", config="sm80_128x128x32_s4")
    _fake_device(monkeypatch, 80)
    monkeypatch.setenv(gg.ENV_TILE, "pingpong_128x192_c1x1")
    with pytest.raises(ValueError, match="MOE_PRAXIS_GG_TILE.*invalid while the sm_80"):
        gg.choose_sm80_config("fwd", 64, 16, 16, 2)
    monkeypatch.setenv(gg.ENV_TILE, "sm80_128x64x32_s4")
    assert gg.choose_sm80_config("wgrad", 1 << 20, 4096, 4096, 8) == "sm80_128x64x32_s4"


def test_both_families_take_their_ffi_checks_from_the_shared_header():
    """kernels/grouped_gemm_common.h holds the error strings of the grouped GEMM handlers' FFI
    checks (tile, workspace, shapes, alignment, CUDA / CUTLASS failures) and the workspace
    layout; the Hopper and sm_80 headers and handlers use it and keep no copy of their own."""
    kernels = REPO / "kernels"
    common = (kernels / "grouped_gemm_common.h").read_text()
    for helper in ("invalid_tile", "workspace_too_small", "shape_error", "check_multiples_of_8",
                   "cuda_error", "cutlass_error", "zero_range", "Carver"):
        assert re.search(rf"\b{helper}\b", common), helper
    # The Hopper and sm_80 families; the FP8 kernels (grouped_gemm_fp8*) do not use the shared
    # checks yet and keep their own messages.
    sources = {
        p.name: p.read_text()
        for p in kernels.glob("grouped_gemm*")
        if p.name != "grouped_gemm_common.h" and not p.name.startswith("grouped_gemm_fp8")
    }
    assert set(sources) >= {
        "grouped_gemm.cuh", "grouped_gemm_sm80.cuh", "grouped_gemm_fwd.cu",
        "grouped_gemm_sm80_fwd.cu"
    }, sorted(sources)
    for name, text in sources.items():
        for copy in ("is invalid; valid: 0..", "bytes is too small", ": need ", "take(size_t",
                     "make_uint4(0, 0, 0, 0)", "must be multiples of 8"):
            assert copy not in text, f"kernels/{name} keeps its own {copy!r}"
    for name in ("grouped_gemm.cuh", "grouped_gemm_sm80.cuh"):
        assert '#include "grouped_gemm_common.h"' in sources[name], name
        assert "moe_gg_common::invalid_tile(kWho" in sources[name], name
        assert "moe_gg_common::workspace_too_small(kWho" in sources[name], name
    for name, text in sources.items():
        if name.endswith(".cu") and "swiglu" not in name:
            assert "moe_gg_common::shape_error(kWho" in text, name


def test_workspace_bytes():
    for e in (1, 2, 3, 64, 257):
        assert gg.sm80_workspace_bytes(e) % 256 == 0
        assert gg.sm80_workspace_bytes(e) >= 12 * e + 6 * 8 * e  # the header's seven arrays


def test_benchmark_sm80_summary_ratios():
    """The benchmark's sm_80 summary: speed ratios against dense, ragged_dot and the Hopper
    kernel (> 1: the sm_80 kernel is faster) and the fastest sm_80 tile timed."""
    rows = [
        dict(shape="A", dist="skewed", op="fwd", method=meth, ms=ms, tflops=tf, config=cfg)
        for meth, ms, tf, cfg in (("dense", 1.0, 700, "-"), ("ragged", 6.0, 100, "-"),
                                  ("ours", 0.8, 800, "-"), ("sm80", 2.0, 350, "sm80_128x256x64_s3"),
                                  ("sm80[sm80_128x128x32_s4]", 1.6, 420, "sm80_128x128x32_s4"))
    ]
    line = sm80_summary(rows).splitlines()[-1]
    assert "| 0.50 | 3.00 | 0.40 | sm80_128x128x32_s4 (420) |" in line, line
    assert sm80_summary(rows[:3]).count("\n") == 1  # no sm80 rows: the header only


def test_kernels_for_sm80_are_compiled_for_sm80():
    """The router, SwiGLU, permute and aux-loss kernels and the sm_80 grouped GEMM are built
    as sm_80 machine code plus compute_80 PTX (newer GPUs JIT it), and their requirement says
    8.0; the Hopper grouped GEMM and the fused gate/up are sm_90a only, on 9.0."""
    sm80 = {build_kernels.GENCODES["sm_80"], build_kernels.GENCODES["compute_80"]}
    for name in ("router.cu", "swiglu.cu", "permute.cu", "aux_loss.cu", "grouped_gemm_sm80_fwd.cu",
                 "grouped_gemm_sm80_dgrad.cu", "grouped_gemm_sm80_wgrad.cu"):
        assert sm80 <= set(build_kernels.gencodes_for(REPO / "kernels" / name)), name
    for name in ("grouped_gemm_fwd.cu", "grouped_gemm_swiglu.cu"):
        assert build_kernels.gencodes_for(REPO / "kernels" /
                                          name) == [build_kernels.GENCODES["sm_90a"]], name
    for op in ("router", "swiglu", "permute", "aux_loss", "grouped_gemm"):
        assert backend.COMPUTE_CAPABILITY[op] == (80, None), op
    assert backend.COMPUTE_CAPABILITY["gate_up_swiglu"] == backend.GROUPED_GEMM_KERNELS["sm90"]
    assert backend.GROUPED_GEMM_KERNELS == {"sm90": (90, 91), "sm80": (80, None)}


def test_benchmark_sm80_sweep_table_and_rankings_for_the_rule():
    """The sweep (--sm80 --sm80-tiles): which tiles a value selects, the table of every tile's
    TFLOP/s with the fastest marked, and the balanced points' rankings in SM80_MEASURED's form
    (pasted, the rule takes them)."""
    assert parse_sm80_tiles("all") == list(gg.SM80_TILE_CONFIGS)
    assert parse_sm80_tiles("rule") == "rule"
    assert parse_sm80_tiles("sm80_64x256x32_s4,sm80_128x128x64_s3") == [
        "sm80_64x256x32_s4", "sm80_128x128x64_s3"
    ]
    with pytest.raises(ValueError, match=r"'sm80_9x9x9_s9' is invalid; valid: \('sm80_"):
        parse_sm80_tiles("sm80_9x9x9_s9")
    a, b, c = gg.SM80_TILE_CONFIGS[:3]

    def row(shape, dist, op, method, ms, cfg="-"):
        return dict(shape=shape,
                    dist=dist,
                    op=op,
                    method=method,
                    ms=ms,
                    tflops=100 / ms,
                    config=cfg)

    rows = [
        row("A", "balanced", "fwd", "dense", 1.0),
        row("A", "balanced", "fwd", "ragged", 8.0),
        row("A", "balanced", "fwd", "sm80", 2.0, a),
        row("A", "balanced", "fwd", f"sm80[{b}]", 1.6, b),
        row("A", "balanced", "fwd", f"sm80[{c}]", 4.0, c),
        row("A", "skewed", "fwd", "sm80", 2.0, a),
        row("A", "skewed", "fwd", f"sm80[{c}]", 1.0, c),
        row("C", "balanced", "wgrad", "dense", 1.0),
        row("C", "balanced", "wgrad", "sm80", 3.0, c),
    ]
    table = sm80_sweep.sweep_table(rows, [a, b, c]).splitlines()
    assert len(table) == 2 + 3, table
    assert "| A | balanced | fwd | 100 | 50 | **62** | 25 | " in table[2], table[2]
    assert table[2].endswith(f"| {a} | {b} | 0.62 | 5.00 |"), table[2]
    assert "| **100** |" in table[3] and table[3].endswith("| - | - |"), table[3]
    won = sm80_sweep.winners(rows, BENCH_SHAPES)
    assert won == {"fwd": [(BENCH_SHAPES["A"], (b, a, c))], "wgrad": [(BENCH_SHAPES["C"], (c, ))]}
    text = sm80_sweep.winners_literal(won)
    assert text.startswith("SM80_MEASURED = {")
    assert eval(text[len("SM80_MEASURED = "):]) == {op: tuple(v) for op, v in won.items()}
