"""Permute token copies to expert-sorted rows and back.

    permute(x, row_map)[r] = x[row_map[r]]           x: [T, M], row_map: [R] token of row r
    unpermute(y, row_map, T)[t] = sum_{r: row_map[r]=t} y[r]
    permute_pair(x, row_map) = (y, y), y = permute(x, row_map)

Each of permute / unpermute is the other's transpose (so each is the other's backward).
permute_pair gives the rows to two consumers (the gate and up projections): its backward sums
the two cotangents in the unpermute's own pass (x[t] = sum_r (dy1[r] + dy2[r])) instead of
adding them into an [R, M] array first, which autodiff of two uses of one permute would do (a
pass that reads 2 and writes 1 [R, M] array). Rows whose row_map is out
of range (>= T, used for dropped / padded copies, or negative) read zeros and are not written,
as in the kernels (NumPy-style wrapping of negative indices is not the contract).

The kernels find each token's rows through the CSR inverse of row_map. Each builds it (a few
small kernels) unless given `index = permute_index(row_map, T)`, made once and read by every
permute and unpermute of that row_map (moe_block's dispatch: the permute, its backward, the
combine's unpermute and its backward).

CUDA side (kernels/permute.cu): `permute_index_cuda`, and `permute_cuda` / `unpermute_cuda` /
`permute_pair_cuda`, custom_vjps whose forward and backward are each a `platform_call` of a
kernel and the reference.
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


def permute_index_reference(row_map, num_tokens: int):
    """The index of row_map (what moe_permute_index builds; 2 * T + 4 + R int32): offsets
    [T + 2] (offsets[s] = rows listed in slots < s), the fill cursor as the kernel leaves it
    [T + 2], and the lists [R]: each token's rows in increasing order, then slot T, the rows
    outside [0, T) (in increasing order here; in no particular order in the kernel's)."""
    t = num_tokens
    slot = jnp.where((row_map >= 0) & (row_map < t), row_map, t).astype(jnp.int32)
    counts = jnp.bincount(slot, length=t + 1).astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1, ), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    cursor = jnp.concatenate([offsets[1:], offsets[-1:]])
    lists = jnp.argsort(slot, stable=True).astype(jnp.int32)
    return jnp.concatenate([offsets, cursor, lists])


# ------------------------------------------------------------------------------ CUDA side
#
# `index`: None (each kernel builds the CSR inverse of row_map in its workspace) or the index
# from permute_index, made once and read by every permute / unpermute of the same row_map.


def _workspace(num_tokens: int, rows: int):
    """The kernels' int32 workspace or index: the CSR inverse of row_map (2 * T + 4 + R)."""
    return jax.ShapeDtypeStruct((2 * num_tokens + 4 + rows, ), jnp.int32)


def _index_ffi(num_tokens, row_map):
    return ffi("moe_permute_index",
               _workspace(num_tokens, row_map.shape[0]),
               row_map,
               tokens=int(num_tokens))


def _permute_ffi(x, row_map, index):
    r = row_map.shape[0]
    y = jax.ShapeDtypeStruct((r, ) + x.shape[1:], x.dtype)
    if index is None:
        return ffi("moe_permute", (y, _workspace(x.shape[0], r)), x, row_map)[0]
    return ffi("moe_permute_indexed", y, x, row_map, index)


def _unpermute_ffi(num_tokens, y, y2, row_map, index):
    """x[t] = sum of y[r] (+ y2[r] where y2 is given) over t's rows; y2 needs the index."""
    x = jax.ShapeDtypeStruct((num_tokens, ) + y.shape[1:], y.dtype)
    if index is None:
        return ffi("moe_unpermute", (x, _workspace(num_tokens, row_map.shape[0])), y, row_map)[0]
    return ffi("moe_unpermute_indexed", x, y, y if y2 is None else y2, index, two=y2 is not None)


def _permute_ref(x, row_map, index):
    return permute_reference(x, row_map)


def _unpermute_ref(num_tokens, y, y2, row_map, index):
    if y2 is None:
        return unpermute_reference(y, row_map, num_tokens)
    return unpermute2_reference(y, y2, row_map, num_tokens)


def _permute_call(x, row_map, index):
    return platform_call(_permute_ffi, _permute_ref, x, row_map, index)


def _unpermute_call(num_tokens, y, row_map, index, y2=None):
    return platform_call(functools.partial(_unpermute_ffi, num_tokens),
                         functools.partial(_unpermute_ref, num_tokens), y, y2, row_map, index)


def unpermute_rows(y, row_map, num_tokens: int, index, y2=None):
    """x[t] = the sum of y[r] (+ y2[r] where y2 is given) over t's rows, for backward passes (no
    vjp): the unpermute kernel where lowered for CUDA (y2 needs `index`, permute_index_cuda's),
    the reference elsewhere."""
    if y2 is not None and index is None:
        raise ValueError("unpermute_rows: summing two inputs (y2) needs the permute index")
    return _unpermute_call(num_tokens, y, row_map, index, y2=y2)


def _no_cotangent(index):
    return None if index is None else zero_cotangent(index)


def permute_index_cuda(row_map, num_tokens: int):
    """The index kernel (the reference where not lowered for CUDA): row_map [R] int32 -> the
    CSR inverse [2 * T + 4 + R] int32 that the indexed permute and unpermute kernels read."""
    return platform_call(functools.partial(_index_ffi, num_tokens),
                         functools.partial(permute_index_reference, num_tokens=num_tokens), row_map)


@jax.custom_vjp
def permute_cuda(x, row_map, index=None):
    """The permute kernel (the reference where not lowered for CUDA): y[r] = x[row_map[r]]
    (zeros where row_map[r] is outside [0, T)). x: [T, M] f32/bf16; row_map: [R] int32
    -> [R, M]; index: None (the kernel builds the inverse map) or permute_index_cuda(row_map,
    T). Backward: unpermute (reading the same index)."""
    return _permute_call(x, row_map, index)


def _permute_fwd(x, row_map, index):
    return _permute_call(x, row_map, index), (row_map, index, x.shape[0])


def _permute_bwd(res, dy):
    row_map, index, t = res
    return (_unpermute_call(t, dy, row_map, index), zero_cotangent(row_map), _no_cotangent(index))


permute_cuda.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, ))
def unpermute_cuda(y, row_map, num_tokens: int, index=None):
    """The unpermute kernel: x[t] = sum_{r: row_map[r] = t} y[r]. y: [R, M] f32/bf16; row_map:
    [R] int32 -> [T, M]; index as for permute_cuda. Backward: permute."""
    return _unpermute_call(num_tokens, y, row_map, index)


def _unpermute_fwd(y, row_map, num_tokens, index):
    return _unpermute_call(num_tokens, y, row_map, index), (row_map, index)


def _unpermute_bwd(num_tokens, res, dx):
    row_map, index = res
    return _permute_call(dx, row_map, index), zero_cotangent(row_map), _no_cotangent(index)


unpermute_cuda.defvjp(_unpermute_fwd, _unpermute_bwd)


@jax.custom_vjp
def permute_pair_cuda(x, row_map, index):
    """(y, y) with y the permute kernel's rows (x: [T, M] f32/bf16; row_map: [R] int32; index:
    permute_index_cuda's). Backward: one unpermute of both cotangents (the indexed kernel with
    two inputs: x[t] = sum_r (dy1[r] + dy2[r]))."""
    y = _permute_call(x, row_map, index)
    return y, y


def _pair_fwd(x, row_map, index):
    y = _permute_call(x, row_map, index)
    return (y, y), (row_map, index, x.shape[0])


def _pair_bwd(res, dys):
    row_map, index, t = res
    dy1, dy2 = dys
    return (_unpermute_call(t, dy1, row_map, index,
                            y2=dy2), zero_cotangent(row_map), zero_cotangent(index))


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


def permute_index(row_map, num_tokens: int, *, backend: str = "auto"):
    """row_map: [R] int -> the index (the CSR inverse of row_map, int32 [2 * T + 4 + R]) that
    the permute kernels then read instead of each building it (4 to 5 small kernels each), or
    None where the permute does not run the kernels. Pass it as `index` to every permute,
    permute_pair and unpermute of this row_map and num_tokens."""
    if _backend.op_backend(backend, "permute") != "cuda" or row_map.ndim != 1:
        return None
    return permute_index_cuda(row_map.astype(jnp.int32), int(num_tokens))


def permute(x, row_map, *, backend: str = "auto", index=None):
    """x: [T, M], row_map: [R] int -> [R, M]. backend 'cuda': the permute kernel (reading
    `index`, permute_index(row_map, T), where given)."""
    if _backend.op_backend(backend, "permute") == "cuda":
        why = permute_unsupported(x, row_map)
        if not why:
            return permute_cuda(x, row_map.astype(jnp.int32), index)
        _backend.warn_fallback("permute", why)
    return permute_reference(x, row_map)


def permute_pair(x, row_map, *, backend: str = "auto", index=None):
    """x: [T, M], row_map: [R] int -> (y, y), y = permute(x, row_map) [R, M], for two
    consumers. backend 'cuda': the permute kernel, and in the backward one unpermute pass over
    both cotangents (no [R, M] sum of them), both reading `index` (made here if not given);
    elsewhere permute's rows twice."""
    if _backend.op_backend(backend, "permute") == "cuda":
        why = permute_unsupported(x, row_map)
        if not why:
            row_map = row_map.astype(jnp.int32)
            if index is None:
                index = permute_index_cuda(row_map, x.shape[0])
            return permute_pair_cuda(x, row_map, index)
        _backend.warn_fallback("permute", why)
    y = permute_reference(x, row_map)
    return y, y


def unpermute(y, row_map, num_tokens: int, *, backend: str = "auto", index=None):
    """y: [R, M], row_map: [R] int -> [T, M]. backend 'cuda': the unpermute kernel (reading
    `index`, permute_index(row_map, T), where given)."""
    if _backend.op_backend(backend, "unpermute") == "cuda":
        why = permute_unsupported(y, row_map)
        if not why:
            return unpermute_cuda(y, row_map.astype(jnp.int32), int(num_tokens), index)
        _backend.warn_fallback("unpermute", why)
    return unpermute_reference(y, row_map, num_tokens)
