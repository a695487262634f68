"""The combine as one gather-and-sum over each token's k rows (deterministic, no atomics).

Letters: T tokens, k top_k, R rows (expert-sorted token copies), M d_model.

    combine(out, pos, copy, w)[t] = sum_{j < k} w[t, j] * out[pos[t, j]]   (float32 sums)

out: [R, M] expert outputs; pos: [T, k] int32, the row of token copy (t, j) (outside [0, R): no
row, e.g. a dropped copy); copy: [R] int32, the token copy t * k + j of row r (outside
[0, T * k): no copy; pos and copy are each other's inverse on the kept copies); w: [T, k]
float32 routing weights. Backward:

    d_out[r] = w[c] * dy[c // k]   with c = copy[r]   (zeros for rows of no copy)
    dw[t, j] = <dy[t], out[pos[t, j]]>                 (0 for copies of no row)

Reading rows by `pos` replaces the unpermute + weighted-sum composition: the routing weights
are applied here (not in the SwiGLU), no float32 [R, M] product is materialised, and dw is a
dot product per copy instead of a scatter-add of per-row weights back to [T, k].

CUDA side (kernels/combine.cu): `combine_cuda`, a custom_vjp whose forward and backward are
each a `platform_call` of a kernel and the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.vma import vary_together, zero_cotangent


def _gathered(out, pos):
    """out rows at pos, float32 [T, k, M] (zeros where pos is outside [0, R))."""
    r = out.shape[0]
    valid = (pos >= 0) & (pos < r)
    g = jnp.take(out, jnp.where(valid, pos, r), axis=0, mode="fill", fill_value=0)
    return g.astype(jnp.float32), valid


def combine_reference(out, pos, w, out_dtype=None):
    """Pure-JAX combine (the CPU path and test oracle): -> [T, M] in out_dtype (out's dtype by
    default)."""
    g, valid = _gathered(out, pos)
    y = jnp.einsum("tk,tkm->tm",
                   jnp.where(valid, w.astype(jnp.float32), 0.0),
                   g,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or out.dtype)


def combine_bwd_reference(dy, out, pos, copy, w):
    """(d_out [R, M] in out's dtype, dw [T, k] float32) of the combine (module docstring)."""
    t, k = pos.shape
    ok = (copy >= 0) & (copy < t * k)
    c = jnp.where(ok, copy, 0)
    scale = jnp.where(ok, w.reshape(-1)[c], 0.0)
    d_out = (scale[:, None] * dy.astype(jnp.float32)[c // k]).astype(out.dtype)
    g, valid = _gathered(out, pos)
    dw = jnp.einsum("tm,tkm->tk", dy.astype(jnp.float32), g, precision=jax.lax.Precision.HIGHEST)
    dw = jnp.where(valid, dw, 0.0)
    return d_out, dw


# ------------------------------------------------------------------------------ CUDA side


def _fwd_ffi(out_dtype, out, pos, w):
    y = jax.ShapeDtypeStruct((pos.shape[0], out.shape[1]), out_dtype)
    return ffi("moe_combine_fwd", y, out, pos, w)


def _bwd_ffi(dy, out, pos, copy, w):
    res = (jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(pos.shape, jnp.float32))
    return tuple(ffi("moe_combine_bwd", res, dy, out, pos, copy, w))


def _fwd_call(out_dtype, out, pos, w):
    return platform_call(functools.partial(_fwd_ffi, out_dtype),
                         functools.partial(_ref_fwd, out_dtype), out, pos, w)


def _ref_fwd(out_dtype, out, pos, w):
    return combine_reference(out, pos, w, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, ))
def _combine(out, pos, copy, w, out_dtype):
    return _fwd_call(out_dtype, out, pos, w)


def _combine_fwd(out, pos, copy, w, out_dtype):
    return _fwd_call(out_dtype, out, pos, w), (out, pos, copy, w)


def _combine_bwd(out_dtype, res, dy):
    out, pos, copy, w = res
    d_out, dw = platform_call(_bwd_ffi, combine_bwd_reference, dy.astype(out_dtype), out, pos, copy,
                              w)
    return d_out, zero_cotangent(pos), zero_cotangent(copy), dw


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine_cuda(out, pos, copy, w, out_dtype=None):
    """The combine kernels, forward and backward (the references where not lowered for CUDA).
    out: [R, M] f32/bf16; pos: [T, k] int32; copy: [R] int32; w: [T, k] f32 -> [T, M] in
    out_dtype (out's dtype by default; float32 for a bf16 out is allowed)."""
    args = vary_together(out, pos.astype(jnp.int32), copy.astype(jnp.int32),
                         w.astype(jnp.float32))  # one type in, so the cotangents match it
    return _combine(*args, jnp.dtype(out_dtype or out.dtype))


def combine_unsupported(out, pos, out_dtype) -> str:
    """'' if the combine kernels handle these inputs, else why not."""
    if out.ndim != 2 or pos.ndim != 2:
        return f"out must be [R, M] and pos [T, k], got {out.shape} and {pos.shape}"
    pair = (jnp.dtype(out.dtype), jnp.dtype(out_dtype))
    ok = {(jnp.dtype(jnp.bfloat16), ) * 2, (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)),
          (jnp.dtype(jnp.float32), ) * 2}
    if pair not in ok:
        return f"(out, y) dtypes {pair} (bf16/bf16, bf16/f32 or f32/f32 only)"
    return ""


# -------------------------------------------------------------------------------- public


def combine(out, pos, copy, w, *, out_dtype=None, backend: str = "auto"):
    """out: [R, M], pos: [T, k], copy: [R], w: [T, k] -> [T, M] = sum_j w[t, j] * out[pos[t, j]]
    in out_dtype (out's dtype by default). backend 'cuda': the combine kernels; gradients flow
    to out and w (module docstring)."""
    out_dtype = jnp.dtype(out_dtype or out.dtype)
    if _backend.op_backend(backend, "combine") == "cuda":
        why = combine_unsupported(out, pos, out_dtype)
        if not why:
            return combine_cuda(out, pos, copy, w, out_dtype)
        _backend.warn_fallback("combine", why)
    return combine_reference(out, pos, w, out_dtype)
