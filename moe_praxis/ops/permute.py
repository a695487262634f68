"""Permute token copies to expert-sorted rows and back.

    permute(x, row_map)[r] = x[row_map[r]]           x: [T, M], row_map: [R] token of row r
    unpermute(y, row_map, T)[t] = sum_{r: row_map[r]=t} y[r]
    permute_pair(x, row_map) = (y, y), y = permute(x, row_map)

Each of permute / unpermute is the other's transpose (so each is the other's backward).
permute_pair gives the rows to two consumers (the gate and up projections): its backward sums
the two cotangents in the unpermute's own pass (unpermute2: x[t] = sum_r (dy1[r] + dy2[r]))
instead of adding them into an [R, M] array first, which autodiff of two uses of one permute
would do (a pass that reads 2 and writes 1 [R, M] array, and an [R, M] buffer at the peak of
the backward). Rows whose row_map is out
of range (>= T, used for dropped / padded copies, or negative) read zeros and are not written,
as in the kernels (NumPy-style wrapping of negative indices is not the contract).

CUDA side (kernels/permute.cu): `permute_cuda` / `unpermute_cuda` / `permute_pair_cuda`,
custom_vjps whose forward and backward are each a `platform_call` of a kernel and the
reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.vma import zero_cotangent


def _in_range(row_map, num_tokens: int):
    """row_map with every out-of-range entry, negative ones too, set to num_tokens (jnp
    indexing would wrap a negative index to the end)."""
    return jnp.where(row_map < 0, num_tokens, row_map)


def permute_reference(x, row_map):
    return jnp.take(x, _in_range(row_map, x.shape[0]), axis=0, mode="fill", fill_value=0)


def unpermute_reference(y, row_map, num_tokens: int):
    out = jnp.zeros((num_tokens, ) + y.shape[1:], y.dtype)
    return out.at[_in_range(row_map, num_tokens)].add(y, mode="drop")


def unpermute2_reference(y, y2, row_map, num_tokens: int):
    """unpermute(y + y2) with the sums in float32, rounded once to y's dtype (as the kernel)."""
    s = y.astype(jnp.float32) + y2.astype(jnp.float32)
    return unpermute_reference(s, row_map, num_tokens).astype(y.dtype)


# ------------------------------------------------------------------------------ CUDA side


def _workspace(num_tokens: int, rows: int):
    """The kernels' int32 workspace: the CSR inverse of row_map (2 * T + 4 + R elements)."""
    return jax.ShapeDtypeStruct((2 * num_tokens + 4 + rows, ), jnp.int32)


def _permute_ffi(x, row_map):
    r = row_map.shape[0]
    out = (jax.ShapeDtypeStruct((r, ) + x.shape[1:], x.dtype), _workspace(x.shape[0], r))
    return ffi("moe_permute", out, x, row_map)[0]


def _unpermute_ffi(num_tokens, y, row_map):
    r = row_map.shape[0]
    out = (jax.ShapeDtypeStruct((num_tokens, ) + y.shape[1:], y.dtype), _workspace(num_tokens, r))
    return ffi("moe_unpermute", out, y, row_map)[0]


def _unpermute2_ffi(num_tokens, y, y2, row_map):
    r = row_map.shape[0]
    out = (jax.ShapeDtypeStruct((num_tokens, ) + y.shape[1:], y.dtype), _workspace(num_tokens, r))
    return ffi("moe_unpermute2", out, y, y2, row_map)[0]


def _unpermute_ref(num_tokens, y, row_map):
    return unpermute_reference(y, row_map, num_tokens)


def _permute_call(x, row_map):
    return platform_call(_permute_ffi, permute_reference, x, row_map)


def _unpermute_call(num_tokens, y, row_map):
    return platform_call(functools.partial(_unpermute_ffi, num_tokens),
                         functools.partial(_unpermute_ref, num_tokens), y, row_map)


def _unpermute2_call(num_tokens, y, y2, row_map):
    return platform_call(functools.partial(_unpermute2_ffi, num_tokens),
                         functools.partial(unpermute2_reference, num_tokens=num_tokens), y, y2,
                         row_map)


@jax.custom_vjp
def permute_cuda(x, row_map):
    """The permute kernel (the reference where not lowered for CUDA): y[r] = x[row_map[r]]
    (zeros where row_map[r] is outside [0, T)). x: [T, M] f32/bf16; row_map: [R] int32
    -> [R, M]. Backward: unpermute."""
    return _permute_call(x, row_map)


def _permute_fwd(x, row_map):
    return _permute_call(x, row_map), (row_map, x.shape[0])


def _permute_bwd(res, dy):
    row_map, t = res
    return _unpermute_call(t, dy, row_map), zero_cotangent(row_map)


permute_cuda.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, ))
def unpermute_cuda(y, row_map, num_tokens: int):
    """The unpermute kernel: x[t] = sum_{r: row_map[r] = t} y[r]. y: [R, M] f32/bf16; row_map:
    [R] int32 -> [T, M]. Backward: permute."""
    return _unpermute_call(num_tokens, y, row_map)


def _unpermute_fwd(y, row_map, num_tokens):
    return _unpermute_call(num_tokens, y, row_map), row_map


def _unpermute_bwd(num_tokens, row_map, dx):
    return _permute_call(dx, row_map), zero_cotangent(row_map)


unpermute_cuda.defvjp(_unpermute_fwd, _unpermute_bwd)


@jax.custom_vjp
def permute_pair_cuda(x, row_map):
    """(y, y) with y the permute kernel's rows (x: [T, M] f32/bf16; row_map: [R] int32).
    Backward: one unpermute2 of both cotangents."""
    y = _permute_call(x, row_map)
    return y, y


def _pair_fwd(x, row_map):
    y = _permute_call(x, row_map)
    return (y, y), (row_map, x.shape[0])


def _pair_bwd(res, dys):
    row_map, t = res
    dy1, dy2 = dys
    return _unpermute2_call(t, dy1, dy2, row_map), zero_cotangent(row_map)


permute_pair_cuda.defvjp(_pair_fwd, _pair_bwd)


def permute_unsupported(x, row_map) -> str:
    """'' if the permute kernels handle these inputs, else why not."""
    if x.ndim != 2:
        return f"x must be [T, M], got shape {x.shape}"
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        return f"dtype {x.dtype} (float32 / bfloat16 only)"
    if row_map.ndim != 1:
        return f"row_map must be [R], got shape {row_map.shape}"
    return ""


# -------------------------------------------------------------------------------- public


def permute(x, row_map, *, backend: str = "auto"):
    """x: [T, M], row_map: [R] int -> [R, M]. backend 'cuda': the permute kernel."""
    if _backend.op_backend(backend, "permute") == "cuda":
        why = permute_unsupported(x, row_map)
        if not why:
            return permute_cuda(x, row_map.astype(jnp.int32))
        _backend.warn_fallback("permute", why)
    return permute_reference(x, row_map)


def permute_pair(x, row_map, *, backend: str = "auto"):
    """x: [T, M], row_map: [R] int -> (y, y), y = permute(x, row_map) [R, M], for two
    consumers. backend 'cuda': the permute kernel, and in the backward one unpermute2 pass over
    both cotangents (no [R, M] sum of them); elsewhere permute's rows twice."""
    if _backend.op_backend(backend, "permute") == "cuda":
        why = permute_unsupported(x, row_map)
        if not why:
            return permute_pair_cuda(x, row_map.astype(jnp.int32))
        _backend.warn_fallback("permute", why)
    y = permute_reference(x, row_map)
    return y, y


def unpermute(y, row_map, num_tokens: int, *, backend: str = "auto"):
    """y: [R, M], row_map: [R] int -> [T, M]. backend 'cuda': the unpermute kernel."""
    if _backend.op_backend(backend, "unpermute") == "cuda":
        why = permute_unsupported(y, row_map)
        if not why:
            return unpermute_cuda(y, row_map.astype(jnp.int32), int(num_tokens))
        _backend.warn_fallback("unpermute", why)
    return unpermute_reference(y, row_map, num_tokens)
