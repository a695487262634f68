"""Permute token copies to expert-sorted rows and back.

    permute(x, row_map)[r] = x[row_map[r]]           x: [T, M], row_map: [R] token of row r
    unpermute(y, row_map, T)[t] = sum_{r: row_map[r]=t} y[r]

Each is the other's transpose (so each is the other's backward). Rows whose row_map is out
of range (>= T, used for dropped / padded copies) read zeros and are not written.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_praxis.ops import cuda
from moe_praxis.ops.backend import resolve_backend


def permute_reference(x, row_map):
    return jnp.take(x, row_map, axis=0, mode="fill", fill_value=0)


def unpermute_reference(y, row_map, num_tokens: int):
    out = jnp.zeros((num_tokens, ) + y.shape[1:], y.dtype)
    return out.at[row_map].add(y, mode="drop")


def permute(x, row_map, *, backend: str = "auto"):
    """x: [T, M], row_map: [R] int -> [R, M]. backend 'cuda': the permute kernel (ops.cuda)."""
    if resolve_backend(backend, "permute") == "cuda":
        why = cuda.permute_unsupported(x, row_map)
        if not why:
            return cuda.permute(x, row_map.astype(jnp.int32))
        cuda.warn_fallback("permute", why)
    return permute_reference(x, row_map)


def unpermute(y, row_map, num_tokens: int, *, backend: str = "auto"):
    """y: [R, M], row_map: [R] int -> [T, M]. backend 'cuda': the unpermute kernel."""
    if resolve_backend(backend, "unpermute") == "cuda":
        why = cuda.permute_unsupported(y, row_map)
        if not why:
            return cuda.unpermute(y, row_map.astype(jnp.int32), int(num_tokens))
        cuda.warn_fallback("unpermute", why)
    return unpermute_reference(y, row_map, num_tokens)
