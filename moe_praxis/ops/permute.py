"""Permute token copies to expert-sorted rows and back.

    permute(x, row_map)[r] = x[row_map[r]]           x: [T, M], row_map: [R] token of row r
    unpermute(y, row_map, T)[t] = sum_{r: row_map[r]=t} y[r]

Each is the other's transpose (so each is the other's backward). Rows whose row_map is out
of range (>= T, used for dropped / padded copies) read zeros and are not written.
"""

from __future__ import annotations

import jax.numpy as jnp


def permute_reference(x, row_map):
    return jnp.take(x, row_map, axis=0, mode="fill", fill_value=0)


def unpermute_reference(y, row_map, num_tokens: int):
    out = jnp.zeros((num_tokens,) + y.shape[1:], y.dtype)
    return out.at[row_map].add(y, mode="drop")


def permute(x, row_map, *, backend: str = "auto"):
    del backend
    return permute_reference(x, row_map)


def unpermute(y, row_map, num_tokens: int, *, backend: str = "auto"):
    del backend
    return unpermute_reference(y, row_map, num_tokens)
