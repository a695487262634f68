"""FP8 (e4m3) grouped GEMM kernels on Hopper: the FFI wrappers, their references, their layouts.

Two CUDA kernels (kernels/grouped_gemm_fp8*.cu: CUTLASS's sm_90a pointer-array grouped GEMM
with blockwise scaling, float32 accumulation promoted every 128 of K), reading the operand
layouts fixed for MoEConfig.fp8='blockwise' (moe_praxis.ops.fp8 quantizes to them):

    L1 row tiles      x [R, C] -> q [R, C] e4m3, s_t [C/128, R]        (1 x 128 along C)
    L2 weight blocks  w [E, K, N] -> q [E, K, N], qt [E, N, K], s [E, K/128, N/128]
    L3 grouped rows   x [R, C] + group_sizes -> qt [C, Rp] e4m3, s [Rp/128, C],
                      Rp = padded_rows(R, E); group g's rows at the padded columns
                      [P_g, P_g + m_g), P_g = sum_{j<g} round_up(m_j, 128) (sizes clamped to
                      the rows left); zero (scale 1) everywhere else; one scale per 128-row
                      tile and column (the wgrad's scale granularity is 1 along M and N)

    fp8_nt     out[rows of g, n] = sum_k dq(a)[r, k] dq(b[g])[n, k]   (bf16 out [R, N])
               a: L1 over [R, C]; b [E, N, C] e4m3 with scales [E, C/128, N/128].
               forward: b = L2 qt, scales s; dgrad: b = L2 q, scales s transposed.
               Rows past sum(group_sizes) are zero.
    fp8_wgrad  out[g] = sum over group g's rows of dq(x)[r, :]^T dq(dy)[r, :]   ([E, C1, C2],
               bf16 or float32 out); x and dy as L3. Experts with no rows get zeros.

Each wrapper is one `platform_call`: on CUDA the kernel, elsewhere its reference (dequantize
to float32, multiply at HIGHEST precision, round the output as the kernel does), so the same
code runs (and is tested) on the CPU. Whether the kernels may run (compute capability 9.0) is
backend.COMPUTE_CAPABILITY['fp8_grouped_gemm']; moe_praxis.ops.fp8 asks it. Group sizes are
read on the device; no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.fp8.quant import (  # noqa: F401  (padded_rows re-exported: L3's Rp)
    dequantize_rows, dequantize_tiles, grouped_offsets, padded_rows)
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference
from moe_praxis.ops.grouped_gemm_tiles import CUTLASS_WORKSPACE_BYTES, SWIZZLES

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BLOCK = 128
OP = "fp8_grouped_gemm"  # the op name of backend.COMPUTE_CAPABILITY
TARGETS = {
    "nt": "moe_grouped_gemm_fp8_nt",
    "wgrad": "moe_grouped_gemm_fp8_wgrad",
    "wgrad_f32": "moe_grouped_gemm_fp8_wgrad_f32",
}
# The FFI attribute `tile` (kernels/grouped_gemm_fp8.cuh run_fp8_tile): cooperative
# 128x128x128 with a 1x2 cluster (two column tiles share A by TMA multicast), 1x1, or 2x1 (two
# row tiles share B); ping-pong 64x128x128 with a 1x2 cluster (one consumer warpgroup's scale
# promotion and epilogue overlap the other's tensor-core work); and the 2x1 and 1x2 cooperative
# tiles with each 128-deep K block's scale promotion overlapped with the next block's wgmmas
# (two temporary accumulators; kernels/grouped_gemm_fp8_mainloop.cuh).
TILE_CONFIGS = ("coop_128x128x128_c1x2", "coop_128x128x128_c1x1", "coop_128x128x128_c2x1",
                "pingpong_64x128x128_c1x2", "coop_128x128x128_c2x1_overlap",
                "coop_128x128x128_c1x2_overlap")
# The tiles moe_praxis.ops.fp8's CUDA path runs (choose_tile): the overlapped-promotion tiles,
# which were as fast as or faster than their plain twins at A (3-8%) in one run of all of them
# (benchmarks/results/fp8_bench_overlap.json); the 2x1 cluster (two row tiles share each weight
# tile's load) with many rows per group, the 1x2 cluster (two column tiles share the rows' load)
# with few, where the 2x1's rounding of each group's row tiles to pairs wastes more.
TILE_MANY_ROWS = 4  # coop_128x128x128_c2x1_overlap
TILE_FEW_ROWS = 5  # coop_128x128x128_c1x2_overlap
FEW_ROWS_PER_GROUP = 512


def choose_tile(rows: int, num_groups: int) -> int:
    """The tile for `rows` rows over `num_groups` groups (the mean decides, the sizes stay on
    the device): TILE_FEW_ROWS at FEW_ROWS_PER_GROUP rows per group or fewer, else
    TILE_MANY_ROWS."""
    return TILE_FEW_ROWS if rows <= FEW_ROWS_PER_GROUP * num_groups else TILE_MANY_ROWS


# kernels/grouped_gemm_fp8.cuh kFp8GroupArrayBytesPerGroup
GROUP_ARRAY_BYTES_PER_GROUP = 384
WGRAD_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_HI = jax.lax.Precision.HIGHEST


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def workspace_bytes(num_groups: int) -> int:
    """Bytes of the workspace output of one FP8 GEMM call: the group arrays, then CUTLASS's."""
    return _round_up(GROUP_ARRAY_BYTES_PER_GROUP * num_groups, 256) + CUTLASS_WORKSPACE_BYTES


def check_schedule(tile: int, raster: int, swizzle: int) -> None:
    if tile not in range(len(TILE_CONFIGS)):
        raise ValueError(f"FP8 grouped GEMM tile={tile!r} is invalid; valid: 0..."
                         f"{len(TILE_CONFIGS) - 1} ({dict(enumerate(TILE_CONFIGS))})")
    if raster not in (0, 1):
        raise ValueError(f"FP8 grouped GEMM raster={raster!r} is invalid; valid: 0 (along_m), "
                         "1 (along_n)")
    if swizzle not in SWIZZLES:
        raise ValueError(f"FP8 grouped GEMM swizzle={swizzle!r} is invalid; valid: {SWIZZLES}")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"FP8 grouped GEMM: {what}")


def _check_e4m3(**arrays) -> None:
    for name, x in arrays.items():
        _need(x.dtype == E4M3, f"{name} must be float8_e4m3fn, got {x.dtype}")


def _check_f32(**arrays) -> None:
    for name, x in arrays.items():
        _need(x.dtype == jnp.float32, f"{name} must be float32 scales, got {x.dtype}")


def _check_group_sizes(group_sizes, num_groups: int) -> None:
    _need(group_sizes.shape == (num_groups, ),
          f"group_sizes must be [E={num_groups}], got shape {group_sizes.shape}")
    _need(jnp.issubdtype(group_sizes.dtype, jnp.integer),
          f"group_sizes must be integers, got {group_sizes.dtype}")


def check_nt(a, a_scales, b, b_scales, group_sizes) -> None:
    """Raises ValueError naming the first operand of fp8_nt that does not fit."""
    _check_e4m3(a=a, b=b)
    _check_f32(a_scales=a_scales, b_scales=b_scales)
    _need(a.ndim == 2 and b.ndim == 3 and a.shape[1] == b.shape[2],
          f"fp8_nt needs a [R, C] and b [E, N, C]; got {a.shape} and {b.shape}")
    (r, c), (e, n, _) = a.shape, b.shape
    _need(c % BLOCK == 0 and n % BLOCK == 0,
          f"fp8_nt needs C and N multiples of {BLOCK}; got C={c}, N={n}")
    _need(a_scales.shape == (c // BLOCK, r),
          f"a_scales must be [C/128, R] = {(c // BLOCK, r)}, got {a_scales.shape}")
    _need(
        b_scales.shape == (e, c // BLOCK, n // BLOCK),
        f"b_scales must be [E, C/128, N/128] = {(e, c // BLOCK, n // BLOCK)}, got "
        f"{b_scales.shape}")
    _check_group_sizes(group_sizes, e)


def check_wgrad(xt, x_scales, dyt, dy_scales, group_sizes, rows: int, out_dtype) -> None:
    """Raises ValueError naming the first operand of fp8_wgrad that does not fit."""
    _check_e4m3(xt=xt, dyt=dyt)
    _check_f32(x_scales=x_scales, dy_scales=dy_scales)
    _need(
        jnp.dtype(out_dtype) in WGRAD_OUT_DTYPES,
        f"fp8_wgrad out_dtype={jnp.dtype(out_dtype).name} is invalid; valid: bfloat16, "
        "float32")
    _need(group_sizes.ndim == 1, f"group_sizes must be [E], got shape {group_sizes.shape}")
    e = group_sizes.shape[0]
    _check_group_sizes(group_sizes, e)
    rp = padded_rows(rows, e)
    _need(
        xt.ndim == 2 and dyt.ndim == 2 and xt.shape[1] == rp and dyt.shape[1] == rp,
        f"fp8_wgrad needs xt [C1, Rp] and dyt [C2, Rp] with Rp = padded_rows(rows={rows}, "
        f"E={e}) = {rp}; got {xt.shape} and {dyt.shape}")
    c1, c2 = xt.shape[0], dyt.shape[0]
    _need(c1 % BLOCK == 0 and c2 % BLOCK == 0,
          f"fp8_wgrad needs C1 and C2 multiples of {BLOCK}; got C1={c1}, C2={c2}")
    _need(x_scales.shape == (rp // BLOCK, c1),
          f"x_scales must be [Rp/128, C1] = {(rp // BLOCK, c1)}, got {x_scales.shape}")
    _need(dy_scales.shape == (rp // BLOCK, c2),
          f"dy_scales must be [Rp/128, C2] = {(rp // BLOCK, c2)}, got {dy_scales.shape}")


# --------------------------------------------------------------------------- references


def dequantize_blocks_nk(b, b_scales):
    """b [E, N, C] e4m3, scales [E, C/128, N/128] -> float32 [E, N, C]."""
    s = jnp.repeat(jnp.repeat(jnp.swapaxes(b_scales, 1, 2), BLOCK, axis=1), BLOCK, axis=2)
    return b.astype(jnp.float32) * s


def fp8_nt_reference(a, a_scales, b, b_scales, group_sizes):
    """fp8_nt in pure JAX: float32 of the dequantized operands, HIGHEST, bf16 out."""
    out = jax.lax.ragged_dot(dequantize_rows(a, a_scales),
                             jnp.swapaxes(dequantize_blocks_nk(b, b_scales), 1, 2),
                             grouped_offsets(group_sizes, a.shape[0])[1],
                             precision=_HI,
                             preferred_element_type=jnp.float32)
    return out.astype(jnp.bfloat16)


def fp8_wgrad_reference(xt, x_scales, dyt, dy_scales, group_sizes, rows: int, out_dtype):
    """fp8_wgrad in pure JAX: each group's padded rows (zero past its m_g) contracted at
    HIGHEST in float32; empty groups zero."""
    padded = (grouped_offsets(group_sizes, rows)[1] + BLOCK - 1) // BLOCK * BLOCK
    with jax.default_matmul_precision("highest"):  # L3 in its padded row order
        out = grouped_gemm_wgrad_reference(dequantize_tiles(xt.T, x_scales, axis=0),
                                           dequantize_tiles(dyt.T, dy_scales, axis=0), padded)
    return out.astype(out_dtype)


# ------------------------------------------------------------------------------ kernels


def fp8_nt(a,
           a_scales,
           b,
           b_scales,
           group_sizes,
           *,
           tile: int = 0,
           raster: int = 0,
           swizzle: int = 1):
    """The FP8 A x B^T grouped GEMM (module doc): the CUDA kernel where lowered for CUDA, else
    fp8_nt_reference. -> [R, N] bfloat16."""
    check_nt(a, a_scales, b, b_scales, group_sizes)
    check_schedule(tile, raster, swizzle)
    (r, _), (e, n, _) = a.shape, b.shape
    results = (jax.ShapeDtypeStruct(
        (r, n), jnp.bfloat16), jax.ShapeDtypeStruct((workspace_bytes(e), ), jnp.uint8))

    def cuda(a, sa, b, sb, g):
        return ffi(TARGETS["nt"],
                   results,
                   a,
                   sa,
                   b,
                   sb,
                   g,
                   tile=tile,
                   raster=raster,
                   swizzle=swizzle)[0]

    return platform_call(cuda, fp8_nt_reference, a, a_scales, b, b_scales,
                         group_sizes.astype(jnp.int32))


def fp8_wgrad(xt,
              x_scales,
              dyt,
              dy_scales,
              group_sizes,
              rows: int,
              *,
              out_dtype=jnp.bfloat16,
              tile: int = 0,
              raster: int = 0,
              swizzle: int = 1):
    """The FP8 wgrad grouped GEMM (module doc) over L3 operands of `rows` rows: the CUDA
    kernel where lowered for CUDA, else fp8_wgrad_reference. -> [E, C1, C2] out_dtype
    (bfloat16 or float32)."""
    check_wgrad(xt, x_scales, dyt, dy_scales, group_sizes, rows, out_dtype)
    check_schedule(tile, raster, swizzle)
    e, c1, c2 = group_sizes.shape[0], xt.shape[0], dyt.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    target = TARGETS["wgrad_f32" if out_dtype == jnp.float32 else "wgrad"]
    results = (jax.ShapeDtypeStruct(
        (e, c1, c2), out_dtype), jax.ShapeDtypeStruct((workspace_bytes(e), ), jnp.uint8))

    def cuda(xt, xs, dyt, dys, g):
        return ffi(target,
                   results,
                   xt,
                   xs,
                   dyt,
                   dys,
                   g,
                   rows=rows,
                   tile=tile,
                   raster=raster,
                   swizzle=swizzle)[0]

    def reference(xt, xs, dyt, dys, g):
        return fp8_wgrad_reference(xt, xs, dyt, dys, g, rows, out_dtype)

    return platform_call(cuda, reference, xt, x_scales, dyt, dy_scales,
                         group_sizes.astype(jnp.int32))
