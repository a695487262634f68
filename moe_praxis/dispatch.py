"""Dispatch: sort the T*k token copies by expert (and back), with an optional capacity.

Letters: T tokens, k top_k, E experts, R = T*k rows (one per token copy), M d_model.

Rows are sorted by expert id, stable, so an expert's rows keep token order. Copies that are
dropped (over capacity) or belong to padded tokens get the sentinel expert id E: they sort
to the end, belong to no group, read zeros and are never written back. Dropless (the
default) keeps every valid copy. Dropped copies are counted, never silently lost.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatch:
    order: jax.Array  # [R] int32: flat copy index (t * k + j) of each expert-sorted row
    row_map: jax.Array  # [R] int32: token of each sorted row; T for dropped / padded rows
    sorted_experts: jax.Array  # [R] int32: expert of each sorted row; E for dropped / padded
    group_sizes: jax.Array  # [E] int32: rows kept per expert (sum <= R)
    dropped_tokens: jax.Array  # [] int32: valid token copies dropped by the capacity


def capacity_keep(expert_ids, weights, valid, config: MoEConfig, capacity: int):
    """[T, k] bool: which copies fit under `capacity` rows per expert, by `drop_policy`.

    'position': all first choices before any second choice, each in token order (GShard).
    'weight':   larger routing weight first (ties by token order).
    """
    t, k = expert_ids.shape
    e = config.num_experts
    flat_e = jnp.where(valid[:, None], expert_ids, e).reshape(-1)
    if config.drop_policy == "position":
        key = (jnp.arange(k, dtype=jnp.int32)[None, :] * t +
               jnp.arange(t, dtype=jnp.int32)[:, None]).reshape(-1)  # copy t*k+j -> j*T+t
        by_prio = jnp.argsort(key, stable=True)
    else:
        by_prio = jnp.argsort(-weights.reshape(-1), stable=True)
    by_expert = by_prio[jnp.argsort(flat_e[by_prio], stable=True)]  # sorted by (expert, prio)
    sorted_e = flat_e[by_expert]
    starts = jnp.searchsorted(sorted_e, jnp.arange(e + 1, dtype=flat_e.dtype), side="left")
    pos_sorted = jnp.arange(t * k, dtype=jnp.int32) - starts[jnp.minimum(sorted_e, e)]
    pos = jnp.zeros(t * k, jnp.int32).at[by_expert].set(pos_sorted)
    return (pos < capacity).reshape(t, k) & valid[:, None]


def make_dispatch(expert_ids, weights, valid, config: MoEConfig) -> Dispatch:
    """expert_ids, weights: [T, k]; valid: [T] bool -> Dispatch (see the module docstring)."""
    t, k = expert_ids.shape
    e = config.num_experts
    keep = jnp.broadcast_to(valid[:, None], (t, k))
    dropped = jnp.zeros((), jnp.int32)
    if config.capacity_factor is not None:
        keep = capacity_keep(expert_ids, weights, valid, config, config.capacity(t))
        dropped = jnp.sum(valid[:, None] & ~keep, dtype=jnp.int32)
    flat_e = jnp.where(keep, expert_ids, e).reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
    sorted_e = flat_e[order]
    row_map = jnp.where(sorted_e < e, order // k, t).astype(jnp.int32)
    group_sizes = jnp.bincount(flat_e, length=e + 1)[:e].astype(jnp.int32)
    return Dispatch(order=order,
                    row_map=row_map,
                    sorted_experts=sorted_e,
                    group_sizes=group_sizes,
                    dropped_tokens=dropped)


def dispatch_rows(x, d: Dispatch, *, backend: str = "auto"):
    """x: [T, M] -> expert-sorted rows [R, M] (zeros for dropped / padded rows)."""
    return ops.permute(x, d.row_map, backend=backend)


def row_weights(weights, d: Dispatch):
    """weights: [T, k] -> [R] float32 routing weight of each expert-sorted row."""
    return weights.reshape(-1)[d.order].astype(jnp.float32)


def combine_rows(y_rows, weights, d: Dispatch, num_tokens: int, *, backend: str = "auto"):
    """y_rows: [R, M] expert outputs, weights: [T, k] -> [T, M] = sum_j w[t, j] * y[copy t, j].

    The weighted sum is computed in float32 and returned in y_rows.dtype. (moe_block instead
    multiplies the weights into the activation, `expert_ffn(row_weights=...)`, and combines
    with a plain unpermute: no float32 [R, M] copy.)
    """
    scaled = y_rows.astype(jnp.float32) * row_weights(weights, d)[:, None]
    return ops.unpermute(scaled, d.row_map, num_tokens, backend=backend).astype(y_rows.dtype)
