"""Ops that write their output as FP8 in the pass that produces it (layout L1 of
moe_praxis.ops.fp8.quant: q e4m3 [R, C], s_t float32 [C/128, R], 1 x 128 tiles along C).

    swiglu_fp8(gate, up, w)  -> act = silu(gate) * up * w[:, None], q, s_t   (the down
                                projection's FP8 lhs; act in gate.dtype for the wgrad)
    permute_fp8(x, row_map)  -> y = x[row_map], q, s_t   (the gate/up projection's FP8 lhs;
                                y in x.dtype for the wgrad)
    swiglu_bwd_fp8(gate, up, w, dout)
                             -> d gate, d up, (q, s_t) of each, dw   (the SwiGLU's backward;
                                (q, s_t) the gate and up dgrads' FP8 operands, d gate and d up
                                in gate.dtype for the wgrads; not differentiable)

(q, s_t) is exactly fp8_quant.quantize_rows of the op's output as rounded to its dtype, on
every backend. On 'cuda' the output is the kernel's: the permute's is exact; the SwiGLU's is
bitwise the SwiGLU kernel's (ops.swiglu: fast sigmoid for bf16, so the reference's within one
bf16 rounding). Differentiable through that output (straight through the quantization, as
the FP8 GEMM's custom_vjp treats its operands): the SwiGLU's and the permute's backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.fp8.quant import BLOCK, check_rows, quantize_rows_reference, rows_out
from moe_praxis.ops.permute import permute, permute_reference
from moe_praxis.ops.swiglu import no_weights, swiglu, swiglu_bwd_reference, swiglu_reference
from moe_praxis.ops.vma import vary_together, zero_cotangent

# ------------------------------------------------- SwiGLU with its output as L1


def swiglu_fp8_reference(gate, up, weights=None):
    """(act [R, H] in gate.dtype, q, s_t): swiglu_reference, then L1 of act as rounded."""
    act = swiglu_reference(gate, up, weights)
    return (act, ) + quantize_rows_reference(act)


def _swiglu_fp8_ffi(gate, up, w, has_weight):
    out = (jax.ShapeDtypeStruct(gate.shape, gate.dtype), ) + rows_out(gate)
    return tuple(ffi("moe_swiglu_fwd_fp8", out, gate, up, w, has_weight=has_weight))


def _swiglu_fp8_ref(gate, up, w, has_weight):
    return swiglu_fp8_reference(gate, up, w if has_weight else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _swiglu_fp8(gate, up, w, has_weight):
    return platform_call(functools.partial(_swiglu_fp8_ffi, has_weight=has_weight),
                         functools.partial(_swiglu_fp8_ref, has_weight=has_weight), gate, up, w)


def _swiglu_fp8_fwd(gate, up, w, has_weight):
    return _swiglu_fp8(gate, up, w, has_weight), (gate, up, w)


def _swiglu_fp8_bwd(has_weight, res, cts):
    gate, up, w = res
    _, vjp = jax.vjp(lambda g, u, ww: swiglu(g, u, ww
                                             if has_weight else None, backend="cuda"), gate, up, w)
    dg, du, dw = vjp(cts[0])
    return dg, du, dw if has_weight else jnp.zeros_like(w)


_swiglu_fp8.defvjp(_swiglu_fp8_fwd, _swiglu_fp8_bwd)


def swiglu_fp8(gate, up, weights=None, *, backend: str = "auto"):
    """SwiGLU forward writing its activation twice in one pass (module doc): gate, up [R, H]
    float32 / bfloat16, H a multiple of 128; weights: optional [R] -> (act [R, H] in
    gate.dtype, q e4m3 [R, H], s_t float32 [H/128, R])."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {gate.shape} and {up.shape}")
    check_rows(gate, "gate")
    if weights is not None and weights.shape != gate.shape[:1]:
        raise ValueError(f"weights must be [R={gate.shape[0]}], got {weights.shape}")
    up = up.astype(gate.dtype)
    if _backend.op_backend(backend, "fp8_quant") != "cuda":
        return swiglu_fp8_reference(gate, up, weights)
    if weights is None:
        return _swiglu_fp8(*vary_together(gate, up), no_weights(), False)
    # autodiff of the cast returns the weights' gradient in their own dtype
    return _swiglu_fp8(*vary_together(gate, up, weights.astype(jnp.float32)), True)


# ------------------------------------------------- permute with its output as L1


def permute_fp8_reference(x, row_map):
    """(y [R, M] = x[row_map] with zeros where row_map is outside [0, T), q, s_t)."""
    y = permute_reference(x, row_map)
    return (y, ) + quantize_rows_reference(y)


def _permute_fp8_ffi(x, row_map):
    y = jax.ShapeDtypeStruct((row_map.shape[0], x.shape[1]), x.dtype)
    return tuple(ffi("moe_permute_fp8", (y, ) + rows_out(y), x, row_map))


@jax.custom_vjp
def _permute_fp8(x, row_map):
    return platform_call(_permute_fp8_ffi, permute_fp8_reference, x, row_map)


def _permute_fp8_fwd(x, row_map):
    return _permute_fp8(x, row_map), (x, row_map)


def _permute_fp8_bwd(res, cts):
    x, row_map = res
    _, vjp = jax.vjp(lambda a: permute(a, row_map, backend="cuda"), x)
    return vjp(cts[0])[0], zero_cotangent(row_map)


_permute_fp8.defvjp(_permute_fp8_fwd, _permute_fp8_bwd)


def permute_fp8(x, row_map, *, backend: str = "auto"):
    """Permute writing its rows twice in one pass (module doc): x [T, M] float32 / bfloat16, M
    a multiple of 128; row_map [R] int -> (y [R, M] in x.dtype, q e4m3 [R, M],
    s_t float32 [M/128, R]). The kernel is the row-major gather (each row reads its token)."""
    check_rows(x, "x")
    if row_map.ndim != 1 or not jnp.issubdtype(row_map.dtype, jnp.integer):
        raise ValueError(f"row_map must be [R] integers, got shape {tuple(row_map.shape)} "
                         f"dtype {row_map.dtype}")
    if _backend.op_backend(backend, "fp8_quant") != "cuda":
        return permute_fp8_reference(x, row_map)
    return _permute_fp8(x, row_map.astype(jnp.int32))


# ------------------------------------------------- SwiGLU backward with both gradients as L1


def swiglu_bwd_fp8_reference(gate, up, weights, dout):
    """(dgate, dup, (qg, sg_t), (qu, su_t), dw): swiglu_reference's backward (dw None without
    weights), then L1 of dgate and of dup as rounded."""
    dg, du, dw = swiglu_bwd_reference(gate, up, weights, dout)
    return dg, du, quantize_rows_reference(dg), quantize_rows_reference(du), dw


def _swiglu_bwd_fp8_ffi(gate, up, w, dout, has_weight):
    r, h = gate.shape
    grads = (jax.ShapeDtypeStruct(gate.shape, gate.dtype), ) * 2
    part = jax.ShapeDtypeStruct((h // BLOCK, r) if has_weight else (1, ), jnp.float32)
    dg, du, qg, sg, qu, su, dw_part = ffi("moe_swiglu_bwd_fp8",
                                          grads + rows_out(gate) + rows_out(gate) + (part, ),
                                          gate,
                                          up,
                                          w,
                                          dout,
                                          has_weight=has_weight)
    # the kernel's per-tile partial sums of the routing weight's gradient, summed here
    dw = jnp.sum(dw_part, axis=0) if has_weight else jnp.zeros_like(w)
    return dg, du, qg, sg, qu, su, dw


def _swiglu_bwd_fp8_ref(gate, up, w, dout, has_weight):
    dg, du, (qg, sg), (qu, su), dw = swiglu_bwd_fp8_reference(gate, up, w if has_weight else None,
                                                              dout)
    return dg, du, qg, sg, qu, su, dw if has_weight else jnp.zeros_like(w)


def swiglu_bwd_fp8(gate, up, weights, dout, *, backend: str = "auto"):
    """The SwiGLU backward writing d gate and d up twice in one pass (module doc): gate, up,
    dout [R, H] float32 / bfloat16 (one dtype), H a multiple of 128; weights: optional [R] ->
    (dgate, dup [R, H] in gate.dtype, (qg e4m3 [R, H], sg_t float32 [H/128, R]), (qu, su_t),
    dw float32 [R] or None without weights). Each (q, s_t) is fp8_quant.quantize_rows of its
    gradient as rounded, on every backend."""
    if gate.shape != up.shape or dout.shape != gate.shape:
        raise ValueError(f"gate, up and dout must have one shape, got {gate.shape}, {up.shape} "
                         f"and {dout.shape}")
    check_rows(gate, "gate")
    if weights is not None and weights.shape != gate.shape[:1]:
        raise ValueError(f"weights must be [R={gate.shape[0]}], got {weights.shape}")
    up, dout = up.astype(gate.dtype), dout.astype(gate.dtype)
    if _backend.op_backend(backend, "fp8_quant") != "cuda":
        return swiglu_bwd_fp8_reference(gate, up, weights, dout)
    has_weight = weights is not None
    if has_weight:
        gate, up, w, dout = vary_together(gate, up, weights.astype(jnp.float32), dout)
    else:  # as swiglu_fp8: no_weights() left alone
        (gate, up, dout), w = vary_together(gate, up, dout), no_weights()
    dg, du, qg, sg, qu, su, dw = platform_call(
        functools.partial(_swiglu_bwd_fp8_ffi, has_weight=has_weight),
        functools.partial(_swiglu_bwd_fp8_ref, has_weight=has_weight), gate, up, w, dout)
    return dg, du, (qg, sg), (qu, su), dw if has_weight else None
