"""Grouped GEMM kernel configurations: the compiled tiles, their workspace, and the rule.

A configuration is a compiled tile from TILE_CONFIGS, a raster order and a swizzle (and an
optional row split): `parse_config` / `config_name`. `choose_config` is the rule that picks one
per GEMM (docs/grouped_gemm.md gives the measurements behind it); the environment variable
MOE_PRAXIS_GG_TILE forces one. `workspace_bytes` sizes the workspace output buffer of one FFI
call (kernels/grouped_gemm_prepare.cuh reads the same layout).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp

# Compiled tile configurations. Index = the `tile` attribute of the FFI handlers
# (kernels/grouped_gemm.cuh, dispatch_tile).
TILE_CONFIGS = (
    "coop_256x128_c2x1",  # 0: cooperative, tile 256x128x64, cluster 2x1
    "pingpong_128x128_c2x1",  # 1: ping-pong, tile 128x128x64, cluster 2x1
    "coop_128x256_c2x1",  # 2: cooperative, tile 128x256x64, cluster 2x1
    "pingpong_64x256_c2x1",  # 3: ping-pong, tile 64x256x64, cluster 2x1 (ragged small groups)
    # 4: tiles 2 or 3, chosen on the device at every call from the group sizes (the tiles each
    # would issue; kernels/grouped_gemm_tiles.cuh, Adaptive)
    "adaptive_128x256_64x256",
    # 5-7: 2, 3 and 4 with 1x2 clusters (A multicast; a problem's column tiles are rounded up
    # to even counts instead of its row tiles)
    "coop_128x256_c1x2",
    "pingpong_64x256_c1x2",
    "adaptive_128x256_64x256_c1x2",
    # 8-10: 2, 3 and 4 with 1x1 clusters (no multicast, no rounding)
    "coop_128x256_c1x1",
    "pingpong_64x256_c1x1",
    "adaptive_128x256_64x256_c1x1",
    # 11-12: ping-pong, tile 128x192x64 (narrow outputs; its epilogue overlaps a mainloop)
    "pingpong_128x192_c1x1",
    "pingpong_128x192_c2x1",
)
# The adaptive pairs (their workspace holds the choice); 4 is the 2x1-cluster one.
ADAPTIVE_TILES = tuple(i for i, t in enumerate(TILE_CONFIGS) if t.startswith("adaptive_"))
ADAPTIVE_TILE = TILE_CONFIGS.index("adaptive_128x256_64x256")
# (cluster rows, cluster columns) of each tile configuration: its `_cMxN` suffix, else 2x1 (the
# 2x1 adaptive pair's name has none)
CLUSTERS = tuple(
    tuple(int(v) for v in m.groups()) if (m := re.search(r"_c(\d)x(\d)$", t)) else (2, 1)
    for t in TILE_CONFIGS)
# Run-time scheduling of the persistent tile scheduler (FFI attributes `raster`, `swizzle`):
# the order in which a group's output tiles are handed out, and the swizzle width. (Without
# host problem shapes CUTLASS's group scheduler derives swizzle 1 whatever is passed: see
# docs/grouped_gemm.md.)
RASTERS = ("along_m", "along_n")
SWIZZLES = (1, 2, 4, 8)
# Row split (FFI attribute `split_rows`, config suffix `/rROWS`): fwd and dgrad (and the fused
# gate/up forward) issue each group's rows as problems of at most ROWS rows, so that a wave of
# CTAs never streams one large group's whole row block per column band
# (kernels/grouped_gemm_prepare.cuh, num_problems). 0: one problem per group. wgrad ignores it
# (its rows are the contraction).
SPLIT_ROWS_MULTIPLE = 256
# The rule's row split: fwd and dgrad problems with more than WIDE_OUT_COLS output columns per
# group run along_m in pieces of at most L2_PIECE_BYTES of bf16 rows x mainloop (measured on
# an H200, 50 MB of L2: docs/grouped_gemm.md, "Large groups").
WIDE_OUT_COLS = 8192
L2_PIECE_BYTES = 32 << 20
# Environment variable that forces one kernel configuration (see `parse_config`) for all three
# GEMMs; unset: `choose_config`.
ENV_TILE = "MOE_PRAXIS_GG_TILE"

OPS = ("fwd", "dgrad", "wgrad")
# Workspace of one FFI call: per-group arrays (kernels/grouped_gemm_prepare.cuh:
# kGroupArrayBytesPerGroup bytes a group, rounded up to 256) + CUTLASS's own workspace (TMA
# descriptors, 128 bytes x a few per SM: ~70 KB on 132 SMs), bounded here; the kernel checks
# the real size and fails with a message naming this constant if it were too small.
GROUP_ARRAY_BYTES_PER_GROUP = 128
CUTLASS_WORKSPACE_BYTES = 1 << 20

_SHAPE_BYTES = 12  # one group's (M, N, K) int32 problem shape


def _round256(n: int) -> int:
    return (n + 255) // 256 * 256


def num_problems(num_groups: int, rows: int = 0, split_rows: int = 0) -> int:
    """CUTLASS problems of one call: one per group, plus at most rows // split_rows more pieces
    with a row split (kernels/grouped_gemm_prepare.cuh, num_problems)."""
    return num_groups + (rows // split_rows if split_rows > 0 else 0)


def _choice_offset(problems: int) -> int:
    """Where the adaptive tile's int32 choice sits in the workspace: after the problem arrays
    and the second kernel's shapes (kernels/grouped_gemm_prepare.cuh, adaptive_bytes)."""
    return (_round256(GROUP_ARRAY_BYTES_PER_GROUP * problems) + _round256(_SHAPE_BYTES * problems))


def workspace_bytes(problems: int, tile: int = 0) -> int:
    """Bytes of the workspace output buffer of one FFI call with `problems` CUTLASS problems
    (`num_problems`); the adaptive tile adds the second kernel's shapes, its choice and its
    CUTLASS workspace."""
    if tile in ADAPTIVE_TILES:
        return _choice_offset(problems) + 256 + 2 * CUTLASS_WORKSPACE_BYTES
    return _round256(GROUP_ARRAY_BYTES_PER_GROUP * problems) + CUTLASS_WORKSPACE_BYTES


def adaptive_choice(workspace, problems: int):
    """From the workspace of an adaptive-tile call with `problems` CUTLASS problems
    (`num_problems`): int32 1 where the device chose the second tile (pingpong_64x256), 0 for
    the first (coop_128x256). For tests and benchmarks."""
    off = _choice_offset(problems)
    return jax.lax.bitcast_convert_type(workspace[off:off + 4].reshape(1, 4), jnp.int32)[0]


def parse_split(text: str) -> int | None:
    """'rROWS' -> ROWS (0 or a multiple of SPLIT_ROWS_MULTIPLE); None if `text` is not one."""
    ok = len(text) > 1 and text[0] == "r" and text[1:].isdigit()
    return int(text[1:]) if ok and int(text[1:]) % SPLIT_ROWS_MULTIPLE == 0 else None


def parse_config(name: str) -> tuple[int, int, int, int]:
    """'TILE[/RASTER[/sSWIZZLE[/rROWS]]]' -> (tile index, raster index, swizzle, split rows).

    TILE from TILE_CONFIGS, RASTER from RASTERS (default along_m), SWIZZLE from SWIZZLES
    (default 1), ROWS the row split (default 0: none; else a multiple of SPLIT_ROWS_MULTIPLE);
    e.g. 'coop_256x128_c2x1/along_n/s2', 'coop_128x256_c2x1/along_m/s1/r2048'.
    """
    parts = str(name).split("/")
    ok = 1 <= len(parts) <= 4 and parts[0] in TILE_CONFIGS
    raster = parts[1] if len(parts) > 1 else RASTERS[0]
    swz = parts[2] if len(parts) > 2 else "s1"
    split = parse_split(parts[3] if len(parts) > 3 else "r0")
    ok = ok and raster in RASTERS and swz in tuple(f"s{v}" for v in SWIZZLES) and split is not None
    if not ok:
        raise ValueError(f"grouped GEMM config {name!r} is invalid; valid: "
                         f"TILE[/RASTER[/sN[/rROWS]]] with TILE in {TILE_CONFIGS}, RASTER in "
                         f"{RASTERS}, N in {SWIZZLES}, ROWS 0 or a multiple of "
                         f"{SPLIT_ROWS_MULTIPLE}")
    return TILE_CONFIGS.index(parts[0]), RASTERS.index(raster), int(swz[1:]), split


def config_name(tile: int, raster: int = 0, swizzle: int = 1, split_rows: int = 0) -> str:
    """Inverse of parse_config (the full form; `/rROWS` only with a row split)."""
    name = f"{TILE_CONFIGS[tile]}/{RASTERS[raster]}/s{swizzle}"
    return name + (f"/r{split_rows}" if split_rows else "")


def choose_config(op: str, m: int, k: int, n: int, num_groups: int) -> str:
    """Kernel configuration (parse_config form) for one GEMM: the rule of docs/grouped_gemm.md.

    op: 'fwd' ([M,K] x [E,K,N]), 'dgrad' ([M,N] x [E,K,N]^T), 'wgrad' ([M,K]^T x [M,N] per
    group). m, k, n, num_groups: the shapes of the *forward* problem. The environment variable
    MOE_PRAXIS_GG_TILE (a parse_config string) overrides the rule.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid; valid: {OPS}")
    forced = os.environ.get(ENV_TILE)
    if forced:
        try:
            return config_name(*parse_config(forced))
        except ValueError as e:
            raise ValueError(f"${ENV_TILE}={forced!r} is invalid: {e}") from None
    rows_per_group = m / max(num_groups, 1)
    # Per group, the GEMM's output is out_rows x out_cols over a mainloop (wgrad: K x N over the
    # group's rows; fwd/dgrad: the group's rows x N over K, or x K over N).
    out_rows, out_cols, mainloop = {
        "fwd": (rows_per_group, n, k),
        "dgrad": (rows_per_group, k, n),
        "wgrad": (k, n, rows_per_group)
    }[op]
    mid = TILE_CONFIGS.index("pingpong_128x192_c1x1")
    if op == "wgrad":
        # wgrad's mainloop is the group's rows. Short mainloops with wide outputs (B: 1024 rows,
        # 7168 x 2048 per group): ping-pong 128x128 hides the epilogue; otherwise (narrow
        # outputs or long mainloops) ping-pong 128x192, measured faster at A and C
        # (docs/grouped_gemm.md)
        tile = 1 if rows_per_group < 2048 and out_cols > 1024 else mid
    elif rows_per_group <= 256:
        # tiny groups: ragged group ends waste a large share of 128-row tiles; the device picks
        # 128x256 or 64x256 at each call from the actual group sizes (docs/grouped_gemm.md)
        tile = TILE_CONFIGS.index("adaptive_128x256_64x256_c1x1")
    elif op == "dgrad" and rows_per_group > 2048:
        tile = 2  # coop_128x256_c2x1 (long dgrad groups: measured faster than ping-pong 128x192)
    else:
        # ping-pong 128x192 with 1x1 clusters: each warpgroup's epilogue overlaps the other's
        # mainloop, and 1x1 clusters round no group's tile grid up (measured faster than
        # cooperative 128x256 at A fwd and at B and C dgrad and C fwd, equal at B fwd)
        tile = mid
    # Wide outputs (fwd/dgrad): a wave of CTAs along a row band reads as many distinct weight
    # tiles as the output has column tiles, from HBM; along_m in row pieces whose bf16 rows x
    # mainloop stay L2-sized re-reads each piece's rows from the L2 (docs/grouped_gemm.md,
    # "Large groups": 16384 rows per group, K=4096, N=14336 forward 23.9 ms against along_n's
    # 32.4).
    wide = op != "wgrad" and out_cols > WIDE_OUT_COLS
    split = (L2_PIECE_BYTES // (2 * mainloop) // SPLIT_ROWS_MULTIPLE *
             SPLIT_ROWS_MULTIPLE if wide else 0)
    # Raster: hand out tiles so that consecutive CTAs share the larger operand tile; along_m
    # for wide outputs and for ping-pong 128x192 always (its along_n measured no faster at any
    # point and up to 1.4x slower at A and at 16384 rows per group).
    raster = 1 if out_rows >= out_cols and tile != mid and not wide else 0
    swizzle = 1  # the only value CUTLASS's group scheduler uses here (docs/grouped_gemm.md)
    return config_name(tile, raster, swizzle, split)
