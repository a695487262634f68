"""Blockwise-scaled FP8 (e4m3) grouped GEMM: the pure-JAX reference of MoEConfig.fp8='blockwise'.

DeepSeek-V3's recipe: activations scaled per 1 x 128 tile along the contraction dimension K,
weights per 128 x 128 block, e4m3 values, float32 accumulation, outputs in the input's dtype.

    scale = amax(tile) * f32(1/448)  (448: e4m3's largest finite value; an all-zero tile has
                                      scale 1; a product, not a quotient, so every
                                      implementation rounds it the same way)
    q     = e4m3(x * (1 / scale))  (a float32 reciprocal per tile; moe_praxis.ops.fp8_quant)

The GEMMs of one grouped GEMM (ragged_dot semantics, moe_praxis.ops.grouped_gemm) and their
operands' quantization:

    forward  y  = lhs @ rhs[g]          lhs 1x128 along K, rhs 128x128
    dgrad    dx = dy @ rhs[g]^T         dy 1x128 along N, rhs the forward's 128x128 blocks
                                        (a 128x128 block is its own transpose's block)
    wgrad    dw = lhs_g^T @ dy_g        lhs and dy 128x1 along the rows (the contraction),
                                        tiles starting at each group's first row, so a
                                        tile never mixes two experts' rows

The quantizers and the operand layouts the FP8 kernels read live in moe_praxis.ops.fp8_quant
(this module re-exports quantize_tiles, quantize_blocks and their inverses); the wgrad's
operands here are its L3 layout, dequantized.

This reference dequantizes to float32 and multiplies at 'highest' precision, which is what an
FP8 tensor-core GEMM with float32 accumulation computes, up to summation order. Kept in the
input dtype: lhs as the backward's residual (wgrad quantizes it along the rows; requantizing
the row-tiled FP8 copy would round twice), and every GEMM's output.

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

from moe_praxis.ops.fp8_quant import (  # noqa: F401  (the recipe's quantizers, re-exported)
    BLOCK, E4M3, E4M3_MAX, check_blocks, dequantize_blocks, dequantize_rows_grouped_t,
    dequantize_tiles, quantize_blocks, quantize_rows_grouped_t_reference, quantize_tiles)
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference

_HI = jax.lax.Precision.HIGHEST


def _fwd_math(lhs, wq, ws, group_sizes):
    k = lhs.shape[1]
    xq, xs = quantize_tiles(lhs, axis=1)
    x = dequantize_tiles(xq, xs, axis=1)[:, :k]
    y = jax.lax.ragged_dot(x,
                           dequantize_blocks(wq, ws),
                           group_sizes.astype(jnp.int32),
                           precision=_HI,
                           preferred_element_type=jnp.float32)
    return y.astype(lhs.dtype)


def _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_dtype):
    gs = group_sizes.astype(jnp.int32)
    n, rows = dy.shape[1], lhs.shape[0]
    dq, ds = quantize_tiles(dy, axis=1)
    dx = jax.lax.ragged_dot(dequantize_tiles(dq, ds, axis=1)[:, :n],
                            jnp.swapaxes(dequantize_blocks(wq, ws), 1, 2),
                            gs,
                            precision=_HI,
                            preferred_element_type=jnp.float32).astype(lhs.dtype)
    # 128 x 1 tiles along the rows, the wgrad's contraction, starting at each group's first
    # row (fp8_quant's L3 layout: a tile never mixes two experts' rows)
    xq, xs = quantize_rows_grouped_t_reference(lhs, gs)
    gq, gs_ = quantize_rows_grouped_t_reference(dy, gs)
    with jax.default_matmul_precision("highest"):
        dw = grouped_gemm_wgrad_reference(dequantize_rows_grouped_t(xq, xs, gs, rows),
                                          dequantize_rows_grouped_t(gq, gs_, gs, rows), gs)
    return dx, dw.astype(rhs_dtype)


@jax.custom_vjp
def fp8_grouped_gemm(lhs, rhs, group_sizes):
    """ragged_dot(lhs [R, K], rhs [E, K, N], group_sizes [E]) in blockwise FP8 (module doc);
    K and N multiples of 128; output in lhs.dtype; gradients for lhs and rhs in FP8 too."""
    wq, ws = quantize_blocks(rhs)
    return _fwd_math(lhs, wq, ws, group_sizes)


def _fp8_fwd(lhs, rhs, group_sizes):
    wq, ws = quantize_blocks(rhs)
    # a zero-size array carries rhs's dtype (residuals must be JAX values)
    return _fwd_math(lhs, wq, ws,
                     group_sizes), (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs.dtype))


def _fp8_bwd(res, dy):
    lhs, wq, ws, group_sizes, rhs_like = res
    dx, dw = _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_like.dtype)
    return dx, dw, None


fp8_grouped_gemm.defvjp(_fp8_fwd, _fp8_bwd)


def check_shard_blocks(local_shape, gather_dim: int, what: str) -> None:
    """A shard gathered along a K or N dim must hold whole 128-row/column blocks."""
    check_blocks(local_shape, f"{what}'s shard")
    if gather_dim not in (0, len(local_shape) - 2, len(local_shape) - 1):
        raise ValueError(f"fp8 gather of {what} along dim {gather_dim} of {tuple(local_shape)}: "
                         "only the expert dim or the last two can be sharded")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gathered_fp8_grouped_gemm(lhs, rhs_shard, group_sizes, axis_name, gather_dim: int):
    """fp8_grouped_gemm with rhs all-gathered over `axis_name` along `gather_dim`, each shard
    quantized BEFORE the gather (inside shard_map). Bitwise equal to gathering rhs and then
    calling fp8_grouped_gemm; the gather moves e4m3 data and float32 scales."""
    out, _ = _gathered_fwd(lhs, rhs_shard, group_sizes, axis_name, gather_dim)
    return out


def _gather_quantized(rhs_shard, axis_name, gather_dim: int):
    check_shard_blocks(rhs_shard.shape, gather_dim, "the expert weight")
    q, s = quantize_blocks(rhs_shard)
    q = jax.lax.all_gather(q, axis_name, axis=gather_dim, tiled=True)
    s = jax.lax.all_gather(s, axis_name, axis=gather_dim, tiled=True)
    return q, s


def _gathered_fwd(lhs, rhs_shard, group_sizes, axis_name, gather_dim):
    wq, ws = _gather_quantized(rhs_shard, axis_name, gather_dim)
    out = _fwd_math(lhs, wq, ws, group_sizes)
    return out, (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs_shard.dtype))


def _gathered_bwd(axis_name, gather_dim, res, dy):
    lhs, wq, ws, group_sizes, rhs_like = res
    # reduced in the weight's dtype, as the transpose of a gather of that dtype would be
    dx, dw = _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_like.dtype)
    dw = jax.lax.psum_scatter(dw, axis_name, scatter_dimension=gather_dim, tiled=True)
    return dx, dw, None


gathered_fp8_grouped_gemm.defvjp(_gathered_fwd, _gathered_bwd)
