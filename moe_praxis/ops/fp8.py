"""Blockwise-scaled FP8 (e4m3) grouped GEMM: the pure-JAX reference of MoEConfig.fp8='blockwise'.

DeepSeek-V3's recipe: activations scaled per 1 x 128 tile along the contraction dimension K,
weights per 128 x 128 block, e4m3 values, float32 accumulation, outputs in the input's dtype.

    scale = amax(tile) * f32(1/448)  (448: e4m3's largest finite value; an all-zero tile has
                                      scale 1; a product, not a quotient, so every
                                      implementation rounds it the same way)
    q     = e4m3(x / scale)    (round to nearest even; |x / scale| <= 448, so no overflow)

The GEMMs of one grouped GEMM (ragged_dot semantics, moe_praxis.ops.grouped_gemm) and their
operands' quantization:

    forward  y  = lhs @ rhs[g]          lhs 1x128 along K, rhs 128x128
    dgrad    dx = dy @ rhs[g]^T         dy 1x128 along N, rhs the forward's 128x128 blocks
                                        (a 128x128 block is its own transpose's block)
    wgrad    dw = lhs_g^T @ dy_g        lhs and dy 128x1 along the rows (the contraction)

This reference dequantizes to float32 and multiplies at 'highest' precision, which is what an
FP8 tensor-core GEMM with float32 accumulation computes, up to summation order. Kept in the
input dtype: lhs as the backward's residual (wgrad quantizes it along the rows; requantizing
the row-tiled FP8 copy would round twice), and every GEMM's output.

Backends (`backend=`: 'auto' | 'xla' | 'cuda', resolved once per call by
backend.op_backend('fp8_grouped_gemm'): compute capability 9.0 with the library built):
'xla' is the reference above; 'cuda' runs the three GEMMs as the FP8 grouped GEMM kernels of
moe_praxis.ops.fp8_gemm on the operand layouts documented there (the forward's lhs and
dgrad's dy in 1x128 row tiles, the weight's 128x128 blocks, the wgrad's lhs and dy in 128-row
tiles that start at each group's first row, so a tile never mixes two experts). The kernels
write bf16 (forward, dgrad; cast to lhs.dtype) and bf16 or float32 (wgrad, the weight's
dtype). On a CPU the 'cuda' path lowers to the kernels' references, so it is testable there.

Quantize-before-gather (`gathered_fp8_grouped_gemm`): under FSDP each device quantizes its own
weight shard and the all-gather moves e4m3 data and float32 scales (about half the bytes of
bf16). 128x128 blocks never straddle a shard boundary (checked by `check_shard_blocks`), so
the result is bitwise the gather-then-quantize one. Its backward reduce-scatters the weight
gradient to the shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_praxis.ops import backend as _backend
from moe_praxis.ops import fp8_gemm
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
_INV_MAX = np.float32(1.0 / E4M3_MAX)
BLOCK = 128
_HI = jax.lax.Precision.HIGHEST


def _scale(amax):
    return jnp.where(amax > 0, amax.astype(jnp.float32) * _INV_MAX, jnp.float32(1.0))


def _pad_to_block(x, axis: int):
    pad = -x.shape[axis] % BLOCK
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quantize_tiles(x, axis: int = -1):
    """1 x 128 tiles along `axis` (zero-padded to a multiple of 128) -> (q e4m3 with the padded
    shape, scales float32 with `axis` divided by 128)."""
    axis = axis % x.ndim
    x = _pad_to_block(x.astype(jnp.float32), axis)
    shape = x.shape
    tiled = x.reshape(shape[:axis] + (shape[axis] // BLOCK, BLOCK) + shape[axis + 1:])
    s = _scale(jnp.max(jnp.abs(tiled), axis=axis + 1))
    q = (tiled / jnp.expand_dims(s, axis + 1)).astype(E4M3)
    return q.reshape(shape), s


def dequantize_tiles(q, s, axis: int = -1):
    axis = axis % q.ndim
    shape = q.shape
    tiled = q.astype(jnp.float32).reshape(shape[:axis] + (shape[axis] // BLOCK, BLOCK) +
                                          shape[axis + 1:])
    return (tiled * jnp.expand_dims(s, axis + 1)).reshape(shape)


def check_blocks(shape, what: str) -> None:
    """The last two dims of a weight must be multiples of 128 (whole 128x128 blocks)."""
    if shape[-1] % BLOCK or shape[-2] % BLOCK:
        raise ValueError(f"fp8='blockwise': {what} has shape {tuple(shape)}; its last two "
                         f"dimensions must be multiples of {BLOCK} (whole {BLOCK}x{BLOCK} "
                         "blocks): use d_model and d_ff that are")


def quantize_blocks(w):
    """w [..., K, N] (K, N multiples of 128) -> (q e4m3 [..., K, N], scales [..., K/128, N/128])."""
    check_blocks(w.shape, "the weight")
    *lead, k, n = w.shape
    b = w.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    s = _scale(jnp.max(jnp.abs(b), axis=(-3, -1)))
    q = (b / s[..., :, None, :, None]).astype(E4M3)
    return q.reshape(w.shape), s


def dequantize_blocks(q, s):
    *lead, k, n = q.shape
    b = q.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    return (b * s[..., :, None, :, None]).reshape(q.shape)


def quantize_rows_grouped_t_reference(x, group_sizes):
    """The wgrad operands' layout (fp8_gemm L3): x [R, C] -> qt [C, Rp] e4m3, s [Rp/128, C];
    group g's rows at padded columns [P_g, P_g + m_g), 128-row tiles from each group's first
    row, zero (scale 1) elsewhere."""
    rows, e = x.shape[0], group_sizes.shape[0]
    rp = fp8_gemm.padded_rows(rows, e)
    m = fp8_gemm.clamped_sizes(group_sizes, rows)
    starts = jnp.cumsum(m) - m
    padded = (m + BLOCK - 1) // BLOCK * BLOCK
    pstarts = jnp.cumsum(padded) - padded
    col = jnp.arange(rp, dtype=jnp.int32)
    g = jnp.clip(jnp.searchsorted(pstarts, col, side="right") - 1, 0, e - 1)
    local = col - pstarts[g]
    valid = (local < m[g]) & (col < jnp.sum(padded))
    src = jnp.where(valid, starts[g] + local, 0)
    xp = jnp.where(valid[:, None], x[src].astype(jnp.float32), 0.0)
    q, s = quantize_tiles(xp, axis=0)
    return q.T, s


def _cuda_nt(x, bq, bs, out_dtype):
    """An FP8 NT grouped GEMM of x's 1x128 row tiles against bq [E, N, C] (scales
    [E, C/128, N/128]) on the CUDA path."""
    q, s = quantize_tiles(x, axis=1)
    return lambda gs: fp8_gemm.fp8_nt(q, s.T, bq, bs, gs).astype(out_dtype)


def _fwd_math(lhs, wq, ws, group_sizes, impl="xla"):
    if impl == "cuda":
        return _cuda_nt(lhs, jnp.swapaxes(wq, 1, 2), ws, lhs.dtype)(group_sizes)
    k = lhs.shape[1]
    xq, xs = quantize_tiles(lhs, axis=1)
    x = dequantize_tiles(xq, xs, axis=1)[:, :k]
    y = jax.lax.ragged_dot(x,
                           dequantize_blocks(wq, ws),
                           group_sizes.astype(jnp.int32),
                           precision=_HI,
                           preferred_element_type=jnp.float32)
    return y.astype(lhs.dtype)


def _cuda_bwd_math(lhs, wq, ws, group_sizes, dy, rhs_dtype):
    dx = _cuda_nt(dy, wq, jnp.swapaxes(ws, 1, 2), lhs.dtype)(group_sizes)
    xt, xs = quantize_rows_grouped_t_reference(lhs, group_sizes)
    dyt, dys = quantize_rows_grouped_t_reference(dy, group_sizes)
    out = jnp.float32 if jnp.dtype(rhs_dtype) == jnp.float32 else jnp.bfloat16
    dw = fp8_gemm.fp8_wgrad(xt, xs, dyt, dys, group_sizes, lhs.shape[0], out_dtype=out)
    return dx, dw.astype(rhs_dtype)


def _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_dtype, impl="xla"):
    if impl == "cuda":
        return _cuda_bwd_math(lhs, wq, ws, group_sizes, dy, rhs_dtype)
    gs = group_sizes.astype(jnp.int32)
    n, rows = dy.shape[1], lhs.shape[0]
    dq, ds = quantize_tiles(dy, axis=1)
    dx = jax.lax.ragged_dot(dequantize_tiles(dq, ds, axis=1)[:, :n],
                            jnp.swapaxes(dequantize_blocks(wq, ws), 1, 2),
                            gs,
                            precision=_HI,
                            preferred_element_type=jnp.float32).astype(lhs.dtype)
    xq, xs = quantize_tiles(lhs, axis=0)  # 128 x 1 tiles along the rows: wgrad's contraction
    gq, gs_ = quantize_tiles(dy, axis=0)
    with jax.default_matmul_precision("highest"):
        dw = grouped_gemm_wgrad_reference(
            dequantize_tiles(xq, xs, axis=0)[:rows],
            dequantize_tiles(gq, gs_, axis=0)[:rows], gs)
    return dx, dw.astype(rhs_dtype)


def resolve(backend: str) -> str:
    """'xla' or 'cuda' for the FP8 GEMMs: backend.op_backend('fp8_grouped_gemm') (compute
    capability 9.0 and the library; a resolved 'cuda' elsewhere falls back with a warning)."""
    return _backend.op_backend(backend, fp8_gemm.OP)


def fp8_grouped_gemm(lhs, rhs, group_sizes, *, backend: str = "auto"):
    """ragged_dot(lhs [R, K], rhs [E, K, N], group_sizes [E]) in blockwise FP8 (module doc);
    K and N multiples of 128; output in lhs.dtype; gradients for lhs and rhs in FP8 too.
    backend: 'auto' | 'xla' | 'cuda' (module doc)."""
    return _fp8_gg(lhs, rhs, group_sizes.astype(jnp.int32), resolve(backend))


def fp8_grouped_gemm_path(lhs, rhs, group_sizes, path: str):
    """fp8_grouped_gemm on the given path, 'xla' or 'cuda', unresolved (tests, benchmarks): on
    a CPU the 'cuda' path lowers each kernel call to its reference (ops.fp8_gemm)."""
    if path not in ("xla", "cuda"):
        raise ValueError(f"fp8_grouped_gemm_path: path={path!r} is invalid; valid: 'xla', 'cuda'")
    return _fp8_gg(lhs, rhs, group_sizes.astype(jnp.int32), path)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _fp8_gg(lhs, rhs, group_sizes, impl):
    wq, ws = quantize_blocks(rhs)
    return _fwd_math(lhs, wq, ws, group_sizes, impl)


def _fp8_fwd(lhs, rhs, group_sizes, impl):
    wq, ws = quantize_blocks(rhs)
    # a zero-size array carries rhs's dtype (residuals must be JAX values)
    return _fwd_math(lhs, wq, ws, group_sizes,
                     impl), (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs.dtype))


def _fp8_bwd(impl, res, dy):
    lhs, wq, ws, group_sizes, rhs_like = res
    dx, dw = _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_like.dtype, impl)
    return dx, dw, None


_fp8_gg.defvjp(_fp8_fwd, _fp8_bwd)


def check_shard_blocks(local_shape, gather_dim: int, what: str) -> None:
    """A shard gathered along a K or N dim must hold whole 128-row/column blocks."""
    check_blocks(local_shape, f"{what}'s shard")
    if gather_dim not in (0, len(local_shape) - 2, len(local_shape) - 1):
        raise ValueError(f"fp8 gather of {what} along dim {gather_dim} of {tuple(local_shape)}: "
                         "only the expert dim or the last two can be sharded")


def gathered_fp8_grouped_gemm(lhs,
                              rhs_shard,
                              group_sizes,
                              axis_name,
                              gather_dim: int,
                              *,
                              backend: str = "auto"):
    """fp8_grouped_gemm with rhs all-gathered over `axis_name` along `gather_dim`, each shard
    quantized BEFORE the gather (inside shard_map). Bitwise equal to gathering rhs and then
    calling fp8_grouped_gemm; the gather moves e4m3 data and float32 scales."""
    return _gathered(lhs, rhs_shard, group_sizes, axis_name, gather_dim, resolve(backend))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gathered(lhs, rhs_shard, group_sizes, axis_name, gather_dim: int, impl: str):
    out, _ = _gathered_fwd(lhs, rhs_shard, group_sizes, axis_name, gather_dim, impl)
    return out


def _gather_quantized(rhs_shard, axis_name, gather_dim: int):
    check_shard_blocks(rhs_shard.shape, gather_dim, "the expert weight")
    q, s = quantize_blocks(rhs_shard)
    q = jax.lax.all_gather(q, axis_name, axis=gather_dim, tiled=True)
    s = jax.lax.all_gather(s, axis_name, axis=gather_dim, tiled=True)
    return q, s


def _gathered_fwd(lhs, rhs_shard, group_sizes, axis_name, gather_dim, impl):
    wq, ws = _gather_quantized(rhs_shard, axis_name, gather_dim)
    out = _fwd_math(lhs, wq, ws, group_sizes, impl)
    return out, (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs_shard.dtype))


def _gathered_bwd(axis_name, gather_dim, impl, res, dy):
    lhs, wq, ws, group_sizes, rhs_like = res
    # reduced in the weight's dtype, as the transpose of a gather of that dtype would be
    dx, dw = _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_like.dtype, impl)
    dw = jax.lax.psum_scatter(dw, axis_name, scatter_dimension=gather_dim, tiled=True)
    return dx, dw, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
