"""Capacity: which token copies each expert keeps, equal to the single-device choice.

Letters: T tokens of the global batch, Tl tokens of one token shard, k top_k, E experts.

With `capacity_factor` each expert keeps at most capacity(T) copies of the GLOBAL batch, in
a global priority order (`drop_policy`), so the keep mask is the same whichever mesh the
block runs on:
  'position': all first choices before any second choice, each in token order (GShard).
  'weight':   larger routing weight first (ties by token order).
The rest are dropped and counted. Without a capacity every valid copy is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.resources import EPLayout, all_gather, psum


def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def capacity_keep(expert_ids,
                  weights,
                  valid,
                  config: MoEConfig,
                  capacity: int,
                  *,
                  backend: str = "auto"):
    """[T, k] bool: which copies fit under `capacity` rows per expert, by `drop_policy`.

    expert_ids, weights: [T, k] of ALL the tokens that compete; valid: [T] bool. The copies in
    priority order are sorted by expert with ops.expert_sort (stable, so each expert's copies
    stay in priority order; its kernels on backend 'cuda').
    """
    t, k = expert_ids.shape
    e = config.num_experts
    flat_e = jnp.where(valid[:, None], expert_ids, e).reshape(-1)
    if config.drop_policy == "position":  # copy t*k+j in (j, t) order: no sort needed
        by_prio = jnp.arange(t * k, dtype=jnp.int32).reshape(t, k).T.reshape(-1)
    else:
        by_prio = jnp.argsort(-weights.reshape(-1), stable=True)
    order, sorted_e, _, sizes = ops.expert_sort(flat_e[by_prio], e, 1, backend=backend)
    by_expert = by_prio[order]  # sorted by (expert, priority)
    pos_sorted = jnp.arange(t * k, dtype=jnp.int32) - _starts(sizes)[sorted_e]
    pos = jnp.zeros(t * k, jnp.int32).at[by_expert].set(pos_sorted)
    return (pos < capacity).reshape(t, k) & valid[:, None]


def _starts(group_sizes):
    """[E + 1] int32: where each expert's copies start in sorted order; E (the copies not kept)
    after the last expert."""
    return jnp.concatenate([jnp.zeros((1, ), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])


def _position_keep(ids, valid, config: MoEConfig, layout: EPLayout, shard, t_global, backend):
    """drop_policy='position' keep mask [Tl, k], equal to the single-device one, from counts.

    Priority is (choice j, global token t). The position of copy (t, j) in expert e is
        #{copies (t', j') -> e : j' < j}                     (all shards)
      + #{copies (t', j) -> e : t' in an earlier token shard}
      + #{copies (t', j) -> e : t' < t in this shard},
    so only the per-shard counts [k, E] are all-gathered ([shards, k, E] int32), never the
    routing decisions themselves."""
    t_l, k = ids.shape
    e = config.num_experts
    axes = layout.token_axes
    eid = jnp.where(valid[:, None], ids, e).astype(jnp.int32)  # [Tl, k], E = padded
    local = jax.vmap(lambda c: jnp.bincount(c, length=e + 1), in_axes=1)(eid)  # [k, E+1]
    every = jax.lax.all_gather(local, axes, axis=0, tiled=False) if axes else local[None]
    before_j = _excl_cumsum(jnp.sum(every, axis=0), axis=0)  # [k, E+1] earlier choices
    before_s = _excl_cumsum(every, axis=0)[shard]  # [k, E+1] earlier shards, same choice

    def rank_in_expert(col):  # [Tl] expert ids -> rank among earlier tokens of that expert
        order, srt, _, sizes = ops.expert_sort(col, e, 1, backend=backend)
        return jnp.zeros_like(col).at[order].set(
            jnp.arange(t_l, dtype=col.dtype) - _starts(sizes)[srt])

    rank = jax.vmap(rank_in_expert, in_axes=1, out_axes=1)(eid)  # [Tl, k]
    col = jnp.arange(k)[None, :]
    pos = before_j[col, eid] + before_s[col, eid] + rank
    return (pos < config.capacity(t_global)) & valid[:, None]


def global_keep(ids,
                weights,
                valid,
                config: MoEConfig,
                layout: EPLayout,
                shard,
                t_global,
                *,
                backend: str = "auto"):
    """One token shard's keep mask [Tl, k], equal to the single-device one on the global batch
    of t_global tokens, and the global drop count [] int32 (psum-ed over the token axes).

    shard: this shard's index over layout.token_axes (0 without a mesh).
    No capacity: every valid copy. 'position': from all-gathered per-shard counts
    (_position_keep). 'weight': the routing decisions (ids and weights) are all-gathered over
    the token axes (in token-shard order, so row s * Tl + t is global token s * Tl + t),
    capacity_keep runs on them with the global capacity(T), and each shard slices its rows.
    With no token axes (one device) this is capacity_keep with capacity(T) of these T tokens.
    """
    t_l, k = ids.shape
    axes = layout.token_axes
    if config.capacity_factor is None:
        return jnp.broadcast_to(valid[:, None], (t_l, k)), jnp.zeros((), jnp.int32)
    if config.drop_policy == "position":
        keep = _position_keep(ids, valid, config, layout, shard, t_global, backend)
    else:
        ids_g = all_gather(ids, axes)
        valid_g = all_gather(valid.astype(jnp.int32), axes) > 0
        w_g = all_gather(jax.lax.stop_gradient(weights), axes)
        keep_g = capacity_keep(ids_g,
                               w_g,
                               valid_g,
                               config,
                               config.capacity(t_global),
                               backend=backend)
        keep = jax.lax.dynamic_slice_in_dim(keep_g, shard * t_l, t_l, axis=0)
    return keep, psum(jnp.sum(valid[:, None] & ~keep, dtype=jnp.int32), axes)
