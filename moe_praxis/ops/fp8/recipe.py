"""Blockwise-scaled FP8 (e4m3) grouped GEMM: the pure-JAX reference of MoEConfig.fp8='blockwise'.

DeepSeek-V3's recipe: activations scaled per 1 x 128 tile along the contraction dimension K,
weights per 128 x 128 block, e4m3 values, float32 accumulation, outputs in the input's dtype.

    scale = amax(tile) * f32(1/448)  (448: e4m3's largest finite value; an all-zero tile has
                                      scale 1; a product, not a quotient, so every
                                      implementation rounds it the same way)
    q     = e4m3(x * (1 / scale))  (a float32 reciprocal per tile; moe_praxis.ops.fp8.quant)

The GEMMs of one grouped GEMM (ragged_dot semantics, moe_praxis.ops.grouped_gemm) and their
operands' quantization:

    forward  y  = lhs @ rhs[g]          lhs 1x128 along K, rhs 128x128
    dgrad    dx = dy @ rhs[g]^T         dy 1x128 along N, rhs the forward's 128x128 blocks
                                        (a 128x128 block is its own transpose's block)
    wgrad    dw = lhs_g^T @ dy_g        lhs and dy 128x1 along the rows (the contraction),
                                        tiles starting at each group's first row, so a
                                        tile never mixes two experts' rows

The quantizers and the operand layouts the FP8 kernels read live in moe_praxis.ops.fp8.quant
(this module re-exports quantize_tiles, quantize_blocks and their inverses); the wgrad's
operands here are its L3 layout, dequantized.

This reference dequantizes to float32 and multiplies at 'highest' precision, which is what an
FP8 tensor-core GEMM with float32 accumulation computes, up to summation order. Kept in the
input dtype: lhs as the backward's residual (wgrad quantizes it along the rows; requantizing
the row-tiled FP8 copy would round twice), and every GEMM's output.

Backends (`backend=`: 'auto' | 'xla' | 'cuda', resolved once per call by
backend.op_backend('fp8_grouped_gemm'): compute capability 9.0 with the library built):
'xla' is the reference above; 'cuda' runs the three GEMMs as the FP8 grouped GEMM kernels of
moe_praxis.ops.fp8.gemm on the operand layouts documented there (the forward's lhs and
dgrad's dy in 1x128 row tiles, the weight's 128x128 blocks, the wgrad's lhs and dy in 128-row
tiles that start at each group's first row, so a tile never mixes two experts). The kernels
write bf16 (forward, dgrad; cast to lhs.dtype) and bf16 or float32 (wgrad, the weight's
dtype). On a CPU the 'cuda' path lowers to the kernels' references, so it is testable there.

GEMMs sharing one lhs (`fp8_gemms_shared_lhs`, the CUDA path of the expert FFN): the gate and
up projections read the same rows, and the down projection reads the SwiGLU's output; the
lhs's L1 operand comes in with it (written by the op that produced the lhs,
ops.fp8.fused.permute_fp8 / swiglu_fp8, or quantize_rows once), and the backward quantizes
lhs for the wgrads once. Each GEMM's numerics are fp8_grouped_gemm's; the lhs's gradient is
the sum of the dgrads, added in float32.

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

from moe_praxis.ops import backend as _backend
from moe_praxis.ops.fp8 import fused as fp8_fused, gemm as fp8_gemm
from moe_praxis.ops.fp8.quant import (  # noqa: F401  (the recipe's quantizers, re-exported)
    BLOCK, E4M3, E4M3_MAX, check_blocks, dequantize_blocks, dequantize_rows_grouped_t,
    dequantize_tiles, quantize_blocks, quantize_rows, quantize_rows_grouped_t,
    quantize_rows_grouped_t_reference, quantize_tiles, quantize_weight)
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference
from moe_praxis.ops.swiglu import named_gate_up, no_weights
from moe_praxis.ops.vma import vary, vary_together, varying_axes

_HI = jax.lax.Precision.HIGHEST

# The CUDA path's quantizers (ops.fp8.quant) with backend 'auto': their kernels wherever the
# FP8 GEMM kernels run; lowered for a CPU, their references (bitwise the same).
_QUANT = "auto"


def _nt(q, s_t, bq, bs, group_sizes, out_dtype):
    """The FP8 NT grouped GEMM of an L1 operand (q, s_t) against bq [E, N, C] (scales
    [E, C/128, N/128]), in out_dtype."""
    tile = fp8_gemm.choose_tile(q.shape[0], bq.shape[0])
    return fp8_gemm.fp8_nt(q, s_t, bq, bs, group_sizes, tile=tile).astype(out_dtype)


def _cuda_nt(x, bq, bs, group_sizes, out_dtype):
    """_nt of x's 1x128 row tiles (L1), quantized here."""
    return _nt(*quantize_rows(x, backend=_QUANT), bq, bs, group_sizes, out_dtype)


def _cuda_wgrad(xt, xs, dy, group_sizes, rows: int, rhs_dtype):
    """The FP8 wgrad of one weight: the lhs's L3 operand (xt, xs) against dy's, quantized here;
    written in float32 for a float32 weight, else bf16, returned in the weight's dtype."""
    dyt, dys = quantize_rows_grouped_t(dy, group_sizes, backend=_QUANT)
    out = jnp.float32 if jnp.dtype(rhs_dtype) == jnp.float32 else jnp.bfloat16
    dw = fp8_gemm.fp8_wgrad(xt,
                            xs,
                            dyt,
                            dys,
                            group_sizes,
                            rows,
                            out_dtype=out,
                            tile=fp8_gemm.choose_tile(rows, group_sizes.shape[0]))
    return dw.astype(rhs_dtype)


def _quantize_weight(rhs, impl):
    """(q [E, K, N], qt [E, N, K] or None, s): the CUDA path's forward reads qt (written in the
    same pass as q), the reference q."""
    if impl == "cuda":
        return quantize_weight(rhs, backend=_QUANT)
    q, s = quantize_blocks(rhs)
    return q, None, s


def _fwd_math(lhs, wq, ws, group_sizes, impl="xla", wqt=None):
    if impl == "cuda":
        wqt = jnp.swapaxes(wq, 1, 2) if wqt is None else wqt
        return _cuda_nt(lhs, wqt, ws, group_sizes, lhs.dtype)
    k = lhs.shape[1]
    xq, xs = quantize_tiles(lhs, axis=1)
    x = dequantize_tiles(xq, xs, axis=1)[:, :k]
    y = jax.lax.ragged_dot(x,
                           dequantize_blocks(wq, ws),
                           group_sizes.astype(jnp.int32),
                           precision=_HI,
                           preferred_element_type=jnp.float32)
    return y.astype(lhs.dtype)


def _dgrad_math(dy, wq, ws, group_sizes, dtype, impl="xla"):
    """The FP8 dgrad dx [R, K] = dy [R, N] @ w^T in `dtype` (dy quantized 1x128 along N)."""
    if impl == "cuda":
        return _cuda_nt(dy.astype(dtype), wq, jnp.swapaxes(ws, 1, 2), group_sizes, dtype)
    n = dy.shape[1]
    dq, ds = quantize_tiles(dy, axis=1)
    return jax.lax.ragged_dot(dequantize_tiles(dq, ds, axis=1)[:, :n],
                              jnp.swapaxes(dequantize_blocks(wq, ws), 1, 2),
                              group_sizes.astype(jnp.int32),
                              precision=_HI,
                              preferred_element_type=jnp.float32).astype(dtype)


def _wgrad_math(lhs, dy, group_sizes, rhs_dtype, impl="xla"):
    """The FP8 wgrad dw [E, K, N] = lhs_g^T @ dy_g in rhs_dtype (both 128x1 along the rows)."""
    if impl == "cuda":
        xt, xs = quantize_rows_grouped_t(lhs, group_sizes, backend=_QUANT)
        return _cuda_wgrad(xt, xs, dy.astype(lhs.dtype), group_sizes, lhs.shape[0], rhs_dtype)
    gs = group_sizes.astype(jnp.int32)
    rows = lhs.shape[0]
    # 128 x 1 tiles along the rows, the wgrad's contraction, starting at each group's first
    # row (fp8_quant's L3 layout: a tile never mixes two experts' rows)
    xq, xs = quantize_rows_grouped_t_reference(lhs, gs)
    gq, gs_ = quantize_rows_grouped_t_reference(dy, gs)
    with jax.default_matmul_precision("highest"):
        dw = grouped_gemm_wgrad_reference(dequantize_rows_grouped_t(xq, xs, gs, rows),
                                          dequantize_rows_grouped_t(gq, gs_, gs, rows), gs)
    return dw.astype(rhs_dtype)


def _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_dtype, impl="xla"):
    return (_dgrad_math(dy, wq, ws, group_sizes, lhs.dtype,
                        impl), _wgrad_math(lhs, dy, group_sizes, rhs_dtype, impl))


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
    a CPU the 'cuda' path lowers each kernel call to its reference (ops.fp8.gemm)."""
    if path not in ("xla", "cuda"):
        raise ValueError(f"fp8_grouped_gemm_path: path={path!r} is invalid; valid: 'xla', 'cuda'")
    return _fp8_gg(lhs, rhs, group_sizes.astype(jnp.int32), path)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _fp8_gg(lhs, rhs, group_sizes, impl):
    wq, wqt, ws = _quantize_weight(rhs, impl)
    return _fwd_math(lhs, wq, ws, group_sizes, impl, wqt)


def _fp8_fwd(lhs, rhs, group_sizes, impl):
    wq, wqt, ws = _quantize_weight(rhs, impl)
    # a zero-size array carries rhs's dtype (residuals must be JAX values)
    return _fwd_math(lhs, wq, ws, group_sizes, impl,
                     wqt), (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs.dtype))


def _fp8_bwd(impl, res, dy):
    lhs, wq, ws, group_sizes, rhs_like = res
    dx, dw = _bwd_math(lhs, wq, ws, group_sizes, dy, rhs_like.dtype, impl)
    return dx, dw, None


_fp8_gg.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_gemms_shared_lhs(lhs, lhs_fp8, rhss, group_sizes, rhss_fp8=None):
    """[fp8_grouped_gemm(lhs, rhs, group_sizes, backend='cuda') for rhs in rhss] with lhs's L1
    operand given (module doc): lhs [R, K] (the backward's residual, in its dtype); lhs_fp8:
    (q e4m3 [R, K], s_t float32 [K/128, R]), fp8_quant.quantize_rows of lhs as rounded, or
    None to quantize here; rhss: a tuple of [E, K, N_i] weights. Returns a tuple of [R, N_i] in
    lhs.dtype. Gradients reach lhs (straight through its L1 operand) and every rhs.
    rhss_fp8: None, or per rhs its L2 operand (q, qt, s) made beforehand (ops.fp8.weights) or
    None to quantize here; a given one gets no gradient (rhs does)."""
    lhs, q, s_t = _lhs_operand(lhs, lhs_fp8)
    rhss_fp8 = jax.lax.stop_gradient(tuple(rhss_fp8 or (None, ) * len(rhss)))
    return _shared(lhs, q, s_t, tuple(rhss), rhss_fp8, group_sizes.astype(jnp.int32))


def _lhs_operand(lhs, lhs_fp8, *others):
    """(lhs, q, s_t, *others): lhs's L1 operand (q, s_t) as given (checked against lhs) or
    quantized here (None), with no gradient of its own, all cast to vary over one set of mesh
    axes under shard_map (the custom_vjps' zero cotangents of q and s_t vary as lhs does)."""
    if lhs_fp8 is None:
        lhs_fp8 = quantize_rows(jax.lax.stop_gradient(lhs), backend=_QUANT)
    q, s_t = (jax.lax.stop_gradient(a) for a in lhs_fp8)
    if q.shape != lhs.shape or s_t.shape != (lhs.shape[1] // BLOCK, lhs.shape[0]):
        raise ValueError(
            f"lhs_fp8 must be (q {tuple(lhs.shape)}, s_t "
            f"{(lhs.shape[1] // BLOCK, lhs.shape[0])}) for lhs {tuple(lhs.shape)}, got "
            f"({tuple(q.shape)}, {tuple(s_t.shape)})")
    return vary_together(lhs, q, s_t, *others)


@jax.custom_vjp
def _shared(lhs, q, s_t, rhss, rhss_fp8, group_sizes):
    return _shared_fwd(lhs, q, s_t, rhss, rhss_fp8, group_sizes)[0]


def _shared_fwd(lhs, q, s_t, rhss, rhss_fp8, group_sizes):
    outs, res_w = [], []
    for rhs, given in zip(rhss, rhss_fp8):
        wq, wqt, ws = _quantize_weight(rhs, "cuda") if given is None else given
        wqt = jnp.swapaxes(wq, 1, 2) if wqt is None else wqt
        outs.append(_nt(q, s_t, wqt, ws, group_sizes, lhs.dtype))
        res_w.append((wq, ws, jnp.zeros((0, ), rhs.dtype)))
    # not q and s_t: their (zero) cotangents need only their shapes, which lhs gives
    return tuple(outs), (lhs, group_sizes, tuple(res_w))


def _shared_grads(lhs, group_sizes, res_w, dys, dys_fp8):
    """(dx in lhs.dtype, the weights' gradients) of _shared: each dy's dgrad reads its L1
    operand from dys_fp8 (written by the op that produced dy) or quantizes it here (None), the
    dgrads summed in float32; the wgrads share one L3 of lhs."""
    xt, xs = quantize_rows_grouped_t(lhs, group_sizes, backend=_QUANT)
    dx, dws = None, []
    for (wq, ws, like), dy, dy_fp8 in zip(res_w, dys, dys_fp8):
        dy = dy.astype(lhs.dtype)
        dq, ds = quantize_rows(dy, backend=_QUANT) if dy_fp8 is None else dy_fp8
        part = _nt(dq, ds, wq, jnp.swapaxes(ws, 1, 2), group_sizes, jnp.float32)
        dx = part if dx is None else dx + part
        dws.append(_cuda_wgrad(xt, xs, dy, group_sizes, lhs.shape[0], like.dtype))
    return dx.astype(lhs.dtype), tuple(dws)


def _lhs_zero_cotangents(lhs):
    """The (zero) cotangents of lhs's L1 operand (q, s_t): straight through to lhs. Under
    shard_map they vary over lhs's axes, as q and s_t do (the callers cast them together)."""
    (r, k), bk = lhs.shape, lhs.shape[1] // BLOCK
    axes = varying_axes(lhs)
    return vary(jnp.zeros((r, k), E4M3), axes), vary(jnp.zeros((bk, r), jnp.float32), axes)


def _shared_bwd(res, dys):
    lhs, group_sizes, res_w = res
    dx, dws = _shared_grads(lhs, group_sizes, res_w, dys, (None, ) * len(dys))
    return (dx, ) + _lhs_zero_cotangents(lhs) + (dws, None, None)


_shared.defvjp(_shared_fwd, _shared_bwd)


def gate_up_swiglu_fp8(lhs, lhs_fp8, w_gate, w_up, group_sizes, row_weights=None, rhss_fp8=None):
    """The FP8 kernels' gate and up projections and their SwiGLU as one op:
    fp8_fused.swiglu_fp8(*fp8_gemms_shared_lhs(lhs, lhs_fp8, (w_gate, w_up), group_sizes,
    rhss_fp8), row_weights), with those outputs (act [R, H] in lhs.dtype and its L1 (q, s_t),
    the down projection's FP8 lhs) and gradients, bitwise. Its backward's SwiGLU
    (fp8_fused.swiglu_bwd_fp8) writes the L1 operands of d gate and d up that the two dgrads
    read, so they are not quantized in a pass of their own. gate and up are residuals of the
    op, named 'moe_gate' and 'moe_up' inside its forward rule (a remat policy that saves the
    names keeps them instead of rerunning the op). row_weights: optional [R] routing weights,
    times the activation (gradient in their dtype)."""
    rhss_fp8 = jax.lax.stop_gradient(tuple(rhss_fp8 or (None, None)))
    if row_weights is None:
        (lhs, q, s_t), w, has_weight = _lhs_operand(lhs, lhs_fp8), no_weights(), False
    else:
        lhs, q, s_t, w = _lhs_operand(lhs, lhs_fp8, row_weights.astype(jnp.float32))
        has_weight = True
    return _gate_up_swiglu(lhs, q, s_t, (w_gate, w_up), rhss_fp8, w, group_sizes.astype(jnp.int32),
                           has_weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, ))
def _gate_up_swiglu(lhs, q, s_t, rhss, rhss_fp8, w, group_sizes, has_weight):
    return _gate_up_swiglu_fwd(lhs, q, s_t, rhss, rhss_fp8, w, group_sizes, has_weight)[0]


def _gate_up_swiglu_fwd(lhs, q, s_t, rhss, rhss_fp8, w, group_sizes, has_weight):
    (gate, up), res = _shared_fwd(lhs, q, s_t, rhss, rhss_fp8, group_sizes)
    gate, up = named_gate_up(gate, up)
    act = fp8_fused.swiglu_fp8(gate, up, w if has_weight else None, backend=_QUANT)
    return tuple(act), (res, gate, up, w)


def _gate_up_swiglu_bwd(has_weight, res, cts):
    (lhs, group_sizes, res_w), gate, up, w = res
    # cts[1:] (act's L1) carry no gradient: straight through act, as in swiglu_fp8
    dg, du, l1_g, l1_u, dw = fp8_fused.swiglu_bwd_fp8(gate,
                                                      up,
                                                      w if has_weight else None,
                                                      cts[0],
                                                      backend=_QUANT)
    dx, dws = _shared_grads(lhs, group_sizes, res_w, (dg, du), (l1_g, l1_u))
    return (dx, ) + _lhs_zero_cotangents(lhs) + (dws, None, dw if has_weight else jnp.zeros_like(w),
                                                 None)


_gate_up_swiglu.defvjp(_gate_up_swiglu_fwd, _gate_up_swiglu_bwd)


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
