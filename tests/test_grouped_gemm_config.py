"""The Hopper grouped GEMM's configurations and the tools around them, on the CPU: configuration
strings, the row-split problem count, the tile rule with MOE_PRAXIS_GG_TILE and its docs, the
kernel table and the shared header's workspace layout, the adaptive tile pair's cost model, and the
grouped GEMM benchmark's helpers (issued tiles, the batched reference, the summary table)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.grouped_gemm_cases import SHAPES, batched_fns, group_sizes, issued_tiles
from benchmarks.grouped_gemm_report import summary_table
from moe_praxis.ops import backend
from moe_praxis.ops import grouped_gemm_tiles as ggt
from tests.grouped_gemm_util import REPO, adaptive_model, gg, hopper_header_text
from tests.testutil import seed as _seed


def test_config_strings_round_trip_and_bad_ones_name_the_valid_forms():
    for tile in range(len(gg.TILE_CONFIGS)):
        for raster in range(len(gg.RASTERS)):
            for split in (0, 256, 4096):
                name = gg.config_name(tile, raster, 1, split)
                assert gg.parse_config(name) == (tile, raster, 1, split)
                assert ("/r" in name) == (split > 0)
    assert gg.parse_config(gg.TILE_CONFIGS[2]) == (2, 0, 1, 0)
    for bad in ("coop_128x256_c2x1/along_m/s1/r100", "coop_128x256_c2x1/along_m/s1/r-256",
                "coop_128x256_c2x1/along_m/s1/rx", "coop_128x256_c2x1/along_m/s3",
                "coop_128x256_c2x1/along_m/s1/r256/x", "big/along_m"):
        with pytest.raises(ValueError, match="invalid; valid: TILE.*multiple of 256"):
            gg.parse_config(bad)


@pytest.mark.parametrize("split", [256, 512, 2048])
def test_row_split_problem_count_bounds_every_group_size_pattern(split):
    """The kernel gives each group max(1, ceil(m / split)) problems
    (kernels/grouped_gemm_prepare.cuh, moe_gg_prepare); num_problems (the arrays' size) must bound that for any sizes, including
    sums past M (clamped) and negative sizes."""
    rng = np.random.default_rng(_seed())
    for _ in range(200):
        e = int(rng.integers(1, 64))
        m = int(rng.integers(1, 8 * split))
        sizes = rng.integers(-3, 2 * m // e + 2, size=e)
        if rng.random() < 0.3:
            sizes = np.zeros(e, np.int64)
            sizes[rng.integers(e)] = m  # one group takes all
        left, pieces = m, 0
        for s in np.maximum(sizes, 0):
            rows = min(int(s), left)
            left -= rows
            pieces += max(1, -(-rows // split))
        assert pieces <= gg.num_problems(e, m, split), (e, m, sizes.tolist())
    assert gg.num_problems(8, 4096, 0) == 8


def test_tile_rule_env_override_and_docs_in_step(monkeypatch):
    doc = (REPO / "docs" / "grouped_gemm.md").read_text()
    for name in gg.TILE_CONFIGS:
        assert f"`{name}`" in doc, f"docs/grouped_gemm.md does not describe tile {name}"
    assert f"`{gg.ENV_TILE}`" in doc
    # Every example of the rule in the docs is what choose_tile returns.
    examples = re.findall(r"`choose_config\('(\w+)', (\d+), (\d+), (\d+), (\d+)\)` -> `([\w/]+)`",
                          doc)
    assert len(examples) >= 6, "docs/grouped_gemm.md lists the rule's examples"
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    for op, m, k, n, e, name in examples:
        got = gg.choose_config(op, int(m), int(k), int(n), int(e))
        assert got == name, f"choose_config({op}, {m}, {k}, {n}, {e}) = {got}, docs say {name}"
    for name in gg.RASTERS:
        assert f"`{name}`" in doc, f"docs/grouped_gemm.md does not describe raster {name}"
    monkeypatch.setenv(gg.ENV_TILE, gg.TILE_CONFIGS[2] + "/along_n")
    assert gg.choose_config("fwd", 32768, 4096, 14336, 8) == gg.TILE_CONFIGS[2] + "/along_n/s1"
    assert gg.parse_config(gg.choose_config("wgrad", 8, 8, 8, 1)) == (2, 1, 1, 0)
    monkeypatch.setenv(gg.ENV_TILE, gg.TILE_CONFIGS[3] + "/along_m/s1/r1024")
    assert gg.parse_config(gg.choose_config("fwd", 8, 8, 8, 1)) == (3, 0, 1, 1024)
    monkeypatch.setenv(gg.ENV_TILE, "huge")
    with pytest.raises(ValueError, match="MOE_PRAXIS_GG_TILE='huge' is invalid"):
        gg.choose_config("fwd", 1, 8, 8, 1)
    with pytest.raises(ValueError, match="op='bwd' is invalid"):
        gg.choose_config("bwd", 1, 8, 8, 1)


def test_kernel_table_lists_the_grouped_gemm_handlers():
    src = "".join((REPO / "kernels" / f"grouped_gemm_{op}.cu").read_text() for op in gg.OPS)
    for op in gg.OPS:
        target = gg.TARGETS[op]
        assert target in backend.KERNELS, f"{target} missing from ops/_library.py KERNELS"
        assert f"XLA_FFI_DEFINE_HANDLER_SYMBOL({backend.KERNELS[target]}," in src
    header = hopper_header_text()
    # the workspace layout of both families lives in the shared header
    common = (REPO / "kernels" / "grouped_gemm_common.h").read_text()
    m = re.search(r"kGroupArrayBytesPerGroup = (\d+);", common)
    assert m and int(m.group(1)) == gg.GROUP_ARRAY_BYTES_PER_GROUP
    for name, family in (("Hopper", header),
                         ("sm80", (REPO / "kernels" / "grouped_gemm_sm80.cuh").read_text())):
        assert '#include "grouped_gemm_common.h"' in family, name
        assert "using moe_gg_common::kGroupArrayBytesPerGroup;" in family, name
        assert not re.search(r"kGroupArrayBytesPerGroup = \d+", family), name
    assert f"constexpr int kNumTiles = {len(gg.TILE_CONFIGS)};" in header


def test_adaptive_model_on_the_benchmark_sizes_picks_the_measured_winners():
    """The 1x1 pair's cost model (per-op factors) on the benchmark's group sizes, 132 SMs: the
    64-row kernel only for dgrad at C skewed; 128 x 256 at B skewed fwd and dgrad; the 2x1 pair
    keeps 64 rows for C skewed fwd and dgrad: where each measured faster
    (benchmarks/results/grouped_gemm_runs.md)."""
    picks = {}
    for tile in (4, 10):
        for shape in ("A", "B", "C"):  # the shapes of those runs
            e, m, k, n = SHAPES[shape]
            for dist in ("balanced", "skewed"):
                sizes = group_sizes(dist, m, e)
                for op, cols in (("fwd", n), ("dgrad", k)):
                    if adaptive_model(sizes, cols, 132, tile, op):
                        picks.setdefault(tile, []).append((shape, dist, op))
    assert picks == {
        4: [("C", "skewed", "fwd"), ("C", "skewed", "dgrad")],
        10: [("C", "skewed", "dgrad")]
    }


def test_benchmark_issued_tiles_counts_each_groups_grid_rounded_to_clusters():
    """The benchmark's tiles / waves column (benchmarks/bench_grouped_gemm.issued_tiles) on
    fresh random group sizes (empty groups included) against a count written out here: per
    group, ceil(rows / tile_m) x ceil(cols / tile_n), each rounded up to the cluster's shape;
    wgrad counts K x N per non-empty group; the adaptive pairs (chosen on the device) give None."""
    rng = np.random.default_rng()
    sizes = rng.integers(0, 3000, size=17)
    sizes[rng.integers(0, 17, size=3)] = 0
    k, n = 1000, 1800

    def count(tm, tn, cm, cn, grids):
        return sum(-(-(-(-r // tm)) // cm) * cm * (-(-(-(-c // tn)) // cn) * cn) for r, c in grids
                   if r > 0)

    for tile, (tm, tn, cm, cn) in {
            "coop_128x256_c2x1": (128, 256, 2, 1),
            "pingpong_64x256_c1x2": (64, 256, 1, 2),
            "coop_128x256_c1x1": (128, 256, 1, 1),
            "pingpong_128x128_c2x1": (128, 128, 2, 1),
            "pingpong_128x192_c1x1": (128, 192, 1, 1),
            "pingpong_128x192_c2x1": (128, 192, 2, 1),
    }.items():
        cfg = gg.config_name(gg.TILE_CONFIGS.index(tile))
        assert issued_tiles(cfg, "fwd", sizes, k, n) == count(tm, tn, cm, cn,
                                                              [(s, n) for s in sizes])
        assert issued_tiles(cfg, "dgrad", sizes, k, n) == count(tm, tn, cm, cn,
                                                                [(s, k) for s in sizes])
        assert issued_tiles(cfg, "wgrad", sizes, k, n) == count(tm, tn, cm, cn, [(k, n)] * int(
            (sizes > 0).sum()))
    for tile in gg.ADAPTIVE_TILES:
        assert issued_tiles(gg.config_name(tile), "fwd", sizes, k, n) is None
    # the benchmark's B skewed fwd with the rule's tile (ping-pong 128x192): 270 row tiles
    # (per group ceil(rows / 128)) x 11 column tiles (2048 / 192, rounded up)
    e, m, k, n = SHAPES["B"]
    cfg = gg.choose_config("fwd", m, k, n, e)
    assert gg.TILE_CONFIGS[gg.parse_config(cfg)[0]] == "pingpong_128x192_c1x1"
    assert issued_tiles(cfg, "fwd", group_sizes("skewed", m, e), k, n) == 2970


def test_benchmark_batched_reference_equals_ragged_reference_on_balanced_groups():
    """The benchmark's `batched` rows (one batched GEMM over [E, M/E, .] rows) compute the same
    fwd, dgrad and wgrad as the ragged references when every group has M/E rows (fresh random
    float32 inputs, 1e-5 relative), and the summary divides them into ours and marks methods
    that were skipped apart from ones that failed."""
    rng = np.random.default_rng()
    e, m, k, n = 4, 48, 24, 40
    lhs, dout = rng.standard_normal((m, k)), rng.standard_normal((m, n))
    rhs = rng.standard_normal((e, k, n))
    lhs, dout, rhs = (jnp.asarray(x, jnp.float32) for x in (lhs, dout, rhs))
    gs = jnp.asarray(group_sizes("balanced", m, e))
    fns = batched_fns(e)
    refs = {
        "fwd": gg.grouped_gemm_reference(lhs, rhs, gs),
        "dgrad": gg.grouped_gemm_dgrad_reference(dout, rhs, gs),
        "wgrad": gg.grouped_gemm_wgrad_reference(lhs, dout, gs),
    }
    for op, ref in refs.items():
        got = np.asarray(fns[op](lhs, rhs, dout, gs), np.float64).reshape(ref.shape)
        ref = np.asarray(ref, np.float64)
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), op
    rows = [
        dict(shape="C", dist="balanced", op="fwd", method=meth, ms=ms, tflops=1.0, config="x")
        for meth, ms in (("dense", 1.0), ("batched", 1.5), ("ours", 2.0))
    ]
    line = summary_table(rows).splitlines()[-1]
    assert line.endswith("| 1.500 ms, 1 | 0.75 |"), line
    assert "| failed | failed |" in line, line  # ragged and Pallas rows missing, not skipped
    line = summary_table(rows, {"ragged", "pallas"}).splitlines()[-1]
    assert "| (skipped) | (skipped) |" in line, line


def test_wide_outputs_run_along_m_in_l2_sized_row_pieces(monkeypatch):
    """fwd/dgrad outputs wider than WIDE_OUT_COLS run along_m in row pieces of at most
    L2_PIECE_BYTES of bf16 rows x mainloop (fwd: K, dgrad: N); wgrad and narrow outputs are
    never split; ping-pong 128 x 192 never runs along_n; docs/grouped_gemm.md states both
    constants."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    mid = gg.TILE_CONFIGS.index("pingpong_128x192_c1x1")
    for m, k, n, e in [(131072, 4096, 14336, 8), (32768, 4096, 14336, 8), (4096, 2048, 9000, 2),
                       (131072, 14336, 4096, 8), (131072, 2048, 768, 128), (65536, 7168, 2048, 64),
                       (8192, 512, 8193, 4), (8192, 512, 8192, 4)]:
        for op in gg.OPS:
            tile, raster, _, split = gg.parse_config(gg.choose_config(op, m, k, n, e))
            out_cols, mainloop = {"fwd": (n, k), "dgrad": (k, n), "wgrad": (n, m // e)}[op]
            if op != "wgrad" and out_cols > ggt.WIDE_OUT_COLS:
                assert raster == 0, (op, m, k, n, e)
                assert split % gg.SPLIT_ROWS_MULTIPLE == 0 and split > 0, (op, m, k, n, e, split)
                assert split * mainloop * 2 <= ggt.L2_PIECE_BYTES, (op, m, k, n, e, split)
                assert (split + gg.SPLIT_ROWS_MULTIPLE) * mainloop * 2 > ggt.L2_PIECE_BYTES
            else:
                assert split == 0, (op, m, k, n, e, split)
            if tile == mid:
                assert raster == 0, (op, m, k, n, e)
    assert gg.parse_config(gg.choose_config("fwd", 131072, 4096, 14336, 8))[3] == 4096
    assert gg.parse_config(gg.choose_config("dgrad", 131072, 14336, 4096, 8))[3] == 4096
    assert gg.parse_config(gg.choose_config("fwd", 4096, 2048, 9000, 2))[3] == 8192
    doc = (REPO / "docs" / "grouped_gemm.md").read_text()
    assert f"`WIDE_OUT_COLS` = {ggt.WIDE_OUT_COLS}" in doc
    assert f"`L2_PIECE_BYTES` = {ggt.L2_PIECE_BYTES >> 20} MiB" in doc
