"""Sort the T*k token copies by expert (and back).

Letters: T tokens, k top_k, E experts, R = T*k rows (one per token copy), M d_model.

Rows are sorted by expert id, stable, so an expert's rows keep token order. Copies that are
not kept (over capacity: dispatch.capacity) or belong to padded tokens get the sentinel
expert id E: they sort to the end, belong to no group, read zeros and are never written
back. Dropless (the default) keeps every valid copy. Dropped copies are counted, never
silently lost.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.ops.fp8 import fused as fp8_fused


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatch:
    order: jax.Array  # [R] int32: flat copy index (t * k + j) of each expert-sorted row
    row_map: jax.Array  # [R] int32: token of each sorted row; T for dropped / padded rows
    sorted_experts: jax.Array  # [R] int32: expert of each sorted row; E for dropped / padded
    group_sizes: jax.Array  # [E] int32: rows kept per expert (sum <= R)
    dropped_tokens: jax.Array  # [] int32: valid token copies dropped by the capacity


def sort_copies(expert_ids,
                keep,
                num_experts: int,
                dropped_tokens,
                *,
                backend: str = "auto") -> Dispatch:
    """expert_ids: [T, k]; keep: [T, k] bool (False = dropped or padded); dropped_tokens: []
    int32 (carried into the Dispatch) -> Dispatch, the kept copies sorted by expert (the stable
    sort of ops.expert_sort: its kernels on backend 'cuda')."""
    k = expert_ids.shape[1]
    flat_e = jnp.where(keep, expert_ids, num_experts).reshape(-1).astype(jnp.int32)
    order, sorted_e, row_map, group_sizes = ops.expert_sort(flat_e, num_experts, k, backend=backend)
    return Dispatch(order=order,
                    row_map=row_map,
                    sorted_experts=sorted_e,
                    group_sizes=group_sizes,
                    dropped_tokens=dropped_tokens)


def dispatch_index(d: Dispatch, num_tokens: int, *, backend: str = "auto"):
    """The permute kernels' index of d.row_map (ops.permute_index), made once for the
    dispatch's permute, the combine's unpermute and their backwards; None where the permute
    does not run the kernels."""
    return ops.permute_index(d.row_map, num_tokens, backend=backend)


def dispatch_rows(x, d: Dispatch, *, backend: str = "auto", index=None):
    """x: [T, M] -> expert-sorted rows [R, M] (zeros for dropped / padded rows); index:
    dispatch_index(d, T) or None."""
    return ops.permute(x, d.row_map, backend=backend, index=index)


def dispatch_rows_pair(x, d: Dispatch, *, backend: str = "auto", index=None):
    """(rows, rows): dispatch_rows(x, d) for two consumers (the gate and up projections), whose
    cotangents the permute's backward sums in its own pass (ops.permute_pair)."""
    return ops.permute_pair(x, d.row_map, backend=backend, index=index)


def dispatch_rows_fp8(x, d: Dispatch):
    """(rows = dispatch_rows(x, d), (q, s_t)): the permute writing the rows' FP8 operand (L1
    row tiles, the gate/up projection's lhs) in the same pass (ops.fp8.fused.permute_fp8)."""
    rows, q, s_t = fp8_fused.permute_fp8(x, d.row_map, backend="auto")
    return rows, (q, s_t)


def row_weights(weights, d: Dispatch):
    """weights: [T, k] -> [R] float32 routing weight of each expert-sorted row."""
    return weights.reshape(-1)[d.order].astype(jnp.float32)


def combine_sorted(rows,
                   w_rows,
                   row_map,
                   num_tokens: int,
                   weighted: bool,
                   *,
                   backend: str,
                   index=None):
    """rows: [R, M] expert outputs in sorted order -> [T, M]: a plain unpermute when the
    routing weights are already in the rows (weighted=False: expert_ffn's row_weights), else
    the float32 sum of w_rows [R] x rows. index: ops.permute_index(row_map, T) or None."""
    if weighted:
        rows = rows.astype(jnp.float32) * w_rows[:, None]
    return ops.unpermute(rows, row_map, num_tokens, backend=backend, index=index)


def combine_gather(rows, weights, d: Dispatch, num_tokens: int, out_dtype, *, backend: str):
    """rows: [R, M] expert outputs (unweighted) in sorted order, weights: [T, k] float32 ->
    [T, M] in out_dtype = sum_j w[t, j] * rows[pos(t, j)], one gather-and-sum (ops.combine);
    pos is the inverse of d.order on the kept copies (R for the others)."""
    t, k = weights.shape
    r = d.order.shape[0]
    kept = d.row_map < num_tokens
    copy = jnp.where(kept, d.order, t * k).astype(jnp.int32)
    pos = jnp.full((t * k, ), r,
                   jnp.int32).at[d.order].set(jnp.where(kept, jnp.arange(r, dtype=jnp.int32), r))
    return ops.combine(rows, pos.reshape(t, k), copy, weights, out_dtype=out_dtype, backend=backend)


def combine_rows(y_rows, weights, d: Dispatch, num_tokens: int, *, backend: str = "auto"):
    """y_rows: [R, M] expert outputs, weights: [T, k] -> [T, M] = sum_j w[t, j] * y[copy t, j].

    The weighted sum is computed in float32 and returned in y_rows.dtype. (moe_block instead
    multiplies the weights into the activation, `expert_ffn(row_weights=...)`, and combines
    with a plain unpermute: no float32 [R, M] copy.)
    """
    scaled = combine_sorted(y_rows,
                            row_weights(weights, d),
                            d.row_map,
                            num_tokens,
                            True,
                            backend=backend)
    return scaled.astype(y_rows.dtype)
