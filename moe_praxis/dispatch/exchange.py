"""Exchange: expert-sorted rows to the EP rank that owns their experts, and back.

Letters: Tl tokens of one device, M d_model, El = E / ep experts of one EP rank, k top_k,
R = Tl * k token copies of one device (sorted by expert: dispatch.sort), ep the EP group
size, C rows a device sends to one rank ('padded'), B rows one rank receives ('ragged').

  'padded': one all_to_all of a [ep, C, M] buffer each way (plus the [ep, El] int32 counts
            and, when the routing weights travel with the rows, their [ep, C] float32).
  'ragged': one jax.lax.ragged_all_to_all each way into a [B, M] buffer (_ragged_move, a
            custom_vjp whose backward is the mirror move with offsets already known).
Defaults: C = R (a device may send all its copies to one rank) and B = ep * R (a rank may
receive all copies of its group), so dropless stays dropless. MoEConfig.ep_buffer_factor =
f bounds them to C = ceil(f * R / ep), B = ceil(f * R) (f x the balanced load); copies past
the bound are not sent, count as overflow (dropped_tokens) and contribute zero.
Received rows are regrouped by local expert (stable: source rank, then source order) for
the experts, which the caller passes in as `experts(rows [N, M], keys [N], row_weights)`
(keys: local expert of each row, El = an empty slot) returning [N, M] in the same slots.
`overlap` (None, or a callable of no arguments) is independent work, such as the shared
experts, that each exchange calls after issuing the dispatch exchange and before the experts
consume its rows, so that its compute can hide the exchange's latency; its result is the
third output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.dispatch.sort import combine_sorted
from moe_praxis.ops import vma

RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def mesh_platform(mesh) -> str:
    """The platform of the mesh's devices ('cpu', 'gpu', 'tpu'); default backend if abstract."""
    try:
        devices = mesh.devices  # an AbstractMesh raises ValueError here
    except (AttributeError, ValueError):
        return jax.default_backend()
    if not hasattr(devices, "flat"):
        return jax.default_backend()
    return next(iter(devices.flat)).platform


# 'auto' on GPUs: XLA:GPU's ragged_all_to_all moved the same bytes 33-50x slower than all_to_all
# on 2 H200s (benchmarks/results/ep_exchange.md), which outweighs the padded exchange's
# worst-case buffers (ep times the balanced bytes and memory) while ep is small; past one
# NVLink node of GPUs those buffers grow too large, so 'auto' goes ragged there.
PADDED_GPU_MAX_EP = 8
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def exchange_kind(config: MoEConfig, mesh, ep_size: int = 2) -> str:
    """'ragged' or 'padded': config.ep_exchange, with 'auto' resolved by the mesh platform and
    the ep size: padded on CPU (XLA:CPU has no ragged_all_to_all) and on GPU meshes with
    ep_size <= PADDED_GPU_MAX_EP; ragged on TPU and on larger GPU meshes."""
    if config.ep_exchange != "auto":
        return config.ep_exchange
    platform = mesh_platform(mesh)
    if platform not in RAGGED_PLATFORMS:
        return "padded"
    if platform in GPU_PLATFORMS and ep_size <= PADDED_GPU_MAX_EP:
        return "padded"
    return "ragged"


def checked_exchange_kind(config: MoEConfig, mesh, ep_size: int = 2) -> str:
    """exchange_kind, refusing 'ragged' where XLA cannot compile ragged_all_to_all."""
    kind = exchange_kind(config, mesh, ep_size)
    if kind == "ragged" and mesh_platform(mesh) not in RAGGED_PLATFORMS:
        raise ValueError(f"MoEConfig.ep_exchange='ragged' needs jax.lax.ragged_all_to_all, which "
                         f"XLA on platform {mesh_platform(mesh)!r} cannot compile; use "
                         "ep_exchange='padded' (or 'auto', which picks it there)")
    return kind


def pair_capacity(rows_local: int, ep_size: int, buffer_factor=None) -> int:
    """Padded exchange: rows a device sends to ONE rank (C). Worst case R = rows_local."""
    if buffer_factor is None:
        return rows_local
    return int(min(rows_local, max(1, math.ceil(buffer_factor * rows_local / ep_size))))


def recv_capacity(rows_local: int, ep_size: int, buffer_factor=None) -> int:
    """Ragged exchange: rows one rank receives in all (B). Worst case ep * rows_local."""
    if buffer_factor is None:
        return ep_size * rows_local
    return int(min(ep_size * rows_local, max(1, math.ceil(buffer_factor * rows_local))))


def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _block_position(i, sizes):
    """For flat positions i [N] in back-to-back blocks of `sizes` [S]: (block [N], offset
    within the block [N], in_range [N]); positions past sum(sizes) have in_range False."""
    ends = jnp.cumsum(sizes)
    block = jnp.searchsorted(ends, i, side="right")
    in_range = block < sizes.shape[0]
    block_c = jnp.minimum(block, sizes.shape[0] - 1)
    return block_c, i - (ends - sizes)[block_c], in_range


def _regroup_keys(src, pos, in_range, recv_mat, num_local):
    """Local expert of each received row: row `pos` of source `src` falls in expert le where
    the cumulative counts recv_mat[src] (sorted by expert) pass pos. Invalid rows -> El."""
    ends = jnp.cumsum(recv_mat, axis=1)[src]  # [N, El]
    le = jnp.sum(pos[:, None] >= ends, axis=1).astype(jnp.int32)
    return jnp.where(in_range, le, num_local)


def regroup(keys, num_local: int, *, backend: str = "auto"):
    """keys: [N] local expert of each received row (num_local = empty slot) -> (perm [N],
    group_sizes [El] int32, inv [N]): rows[perm] are grouped by expert (stable: ops.expert_sort,
    its kernels on backend 'cuda'), and out[inv] puts grouped outputs back in the received
    slots."""
    perm, _, _, group_sizes = ops.expert_sort(keys, num_local, 1, backend=backend)
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    return perm, group_sizes, inv


def fuse_weights(layout) -> bool:
    """Whether the routing weights are multiplied into the experts' activation (the SwiGLU
    kernel's fused weight) and the combine is a plain unpermute in the rows' dtype: yes unless
    tensor parallelism adds partial sums after the combine (then it stays float32, weighted
    after the return trip). The 'ragged' exchange never fuses: moving the weights there takes
    a second ragged_all_to_all, which costs more than the float32 combine it would save
    (docs/parallelism.md, Measurements)."""
    return not layout.tp_axes


def _overlapped(overlap):
    """overlap() where given (called between the dispatch exchange and its consumer: in program
    order the rows are in flight while it runs, which the latency-hiding scheduler keeps)."""
    return overlap() if overlap is not None else None


def padded_exchange(x, row_tok, w_sorted, send_mat, layout, config: MoEConfig, experts, backend, *,
                    overlap):
    """One all_to_all of a [ep, C, M] buffer each way. Returns (y [Tl, M], overflow, overlap()
    or None): y in
    float32 where tp partial sums follow (the weights applied after the return trip), else in
    the rows' dtype (the weights travel with the rows into the activation: fuse_weights).
    row_tok: [R] token of each sorted row (Tl = none); w_sorted: [R] float32 routing weights;
    send_mat: [ep, El] int32 rows for each destination rank's experts; overlap: see the module
    docstring."""
    ep, el = layout.ep_size, layout.experts_per_rank
    axes = layout.ep_axes
    r_rows = row_tok.shape[0]
    t_l = x.shape[0]
    cap = pair_capacity(r_rows, ep, config.ep_buffer_factor)
    send_tot = jnp.sum(send_mat, axis=1)  # [ep]
    sent = jnp.minimum(send_tot, cap)
    slot = jnp.arange(cap, dtype=jnp.int32)
    idx = jnp.minimum(_excl_cumsum(send_tot)[:, None] + slot[None, :], r_rows - 1)  # [ep, C]
    ok = slot[None, :] < sent[:, None]
    slot_tok = jnp.where(ok, row_tok[idx], t_l).reshape(-1)  # [ep*C] token or Tl
    slot_w = jnp.where(ok, w_sorted[idx], 0.0).reshape(-1)
    index = ops.permute_index(slot_tok, t_l, backend=backend)  # for the permute and the combine
    send_buf = ops.permute(x, slot_tok, backend=backend, index=index).reshape(ep, cap, -1)
    recv_mat = jax.lax.all_to_all(send_mat, axes, 0, 0, tiled=True)  # [src, El]
    recv_buf = jax.lax.all_to_all(send_buf, axes, 0, 0, tiled=True)  # [src, C, M]
    side = _overlapped(overlap)
    recv_tot = jnp.minimum(jnp.sum(recv_mat, axis=1), cap)
    src = jnp.repeat(jnp.arange(ep, dtype=jnp.int32), cap)
    pos = jnp.tile(slot, ep)
    keys = _regroup_keys(src, pos, pos < recv_tot[src], recv_mat, el)
    fuse = fuse_weights(layout)
    recv_w = None
    if fuse:  # [src, C] routing weights of the received rows (0 in empty slots)
        recv_w = jax.lax.all_to_all(slot_w.reshape(ep, cap), axes, 0, 0, tiled=True).reshape(-1)
    out = experts(recv_buf.reshape(ep * cap, -1), keys, recv_w)
    back = jax.lax.all_to_all(out.reshape(ep, cap, -1), axes, 0, 0, tiled=True)  # [dst, C, M]
    y = combine_sorted(back.reshape(ep * cap, -1),
                       slot_w,
                       slot_tok,
                       t_l,
                       not fuse,
                       backend=backend,
                       index=index)
    return y, jnp.sum(send_tot - sent), side


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ragged_move(rows, offsets, out_rows: int, axes, vary):
    """ragged_all_to_all of rows [N, M] into a fresh [out_rows, M] buffer.

    offsets: (fwd, bwd), each (input_offsets, send_sizes, output_offsets, recv_sizes) [ep]
    int32, bwd being the mirror move. The backward is that mirror ragged_all_to_all of the
    cotangent, with the offsets we already know (no generic transpose, no extra all_to_all
    of offsets). vary: the mesh axes rows vary over (shard_map's type of the results)."""
    fwd, _ = offsets
    buf = vma.vary(jnp.zeros((out_rows, ) + rows.shape[1:], rows.dtype), vary)
    return vma.vary(jax.lax.ragged_all_to_all(rows, buf, *fwd, axis_name=axes), vary)


def _ragged_move_fwd(rows, offsets, out_rows, axes, vary):
    return _ragged_move(rows, offsets, out_rows, axes, vary), (offsets, rows.shape[0])


def _ragged_move_bwd(out_rows, axes, vary, res, g):
    (fwd, bwd), n = res
    buf = vma.vary(jnp.zeros((n, ) + g.shape[1:], g.dtype), vary)
    g_rows = vma.vary(jax.lax.ragged_all_to_all(vma.vary(g, vary), buf, *bwd, axis_name=axes), vary)
    return g_rows, jax.tree.map(vma.zero_cotangent, (fwd, bwd))


_ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


def ragged_exchange(x, row_tok, w_sorted, send_mat, layout, config: MoEConfig, experts, backend, *,
                    overlap):
    """One ragged_all_to_all each way into a [B, M] buffer. Returns (y [Tl, M] f32, overflow,
    overlap() or None):
    the routing weights are applied after the return trip (see fuse_weights). Arguments as
    padded_exchange's."""
    ep, el = layout.ep_size, layout.experts_per_rank
    axes = layout.ep_axes
    r_rows = row_tok.shape[0]
    t_l = x.shape[0]
    bound = recv_capacity(r_rows, ep, config.ep_buffer_factor)
    me = jax.lax.axis_index(axes)
    send_tot = jnp.sum(send_mat, axis=1).astype(jnp.int32)  # [ep]
    s_all = jax.lax.all_gather(send_tot, axes, axis=0, tiled=False)  # [src, dst]
    out_off = _excl_cumsum(s_all, axis=0)  # where src's block starts at dst
    sz = jnp.clip(bound - out_off, 0, s_all)  # rows that fit, [src, dst]
    in_off = _excl_cumsum(s_all, axis=1)  # where the block starts at src (sorted rows)
    my_send = sz[me]
    my_recv = sz[:, me]

    def nz(off, size):  # offsets of empty slices: 0 (never out of range)
        return jnp.where(size > 0, off, 0).astype(jnp.int32)

    index = ops.permute_index(row_tok, t_l, backend=backend)  # for the permute and the combine
    rows = ops.permute(x, row_tok, backend=backend, index=index)  # [R, M] expert-sorted
    recv_mat = jax.lax.all_to_all(send_mat, axes, 0, 0, tiled=True)  # [src, El]
    there = (nz(in_off[me], my_send), my_send, nz(out_off[me], my_send), my_recv)
    back_again = (nz(out_off[:, me], my_recv), my_recv, nz(in_off[:, me], my_recv), my_send)
    vary = tuple(sorted(vma.varying_axes(rows) | set(axes)))
    recv = _ragged_move(rows, (there, back_again), bound, axes, vary)  # [B, M]
    side = _overlapped(overlap)
    src, pos, in_range = _block_position(jnp.arange(bound, dtype=jnp.int32), my_recv)
    keys = _regroup_keys(src, pos, in_range, recv_mat, el)
    out = experts(recv, keys, None)  # varies over tp too where the experts are tp-sharded
    vary_back = tuple(sorted(vma.varying_axes(out) | set(vary)))
    back = _ragged_move(vma.vary(out, vary_back), (back_again, there), r_rows, axes,
                        vary_back)  # [R, M], 0 if dropped
    y = combine_sorted(back, w_sorted, row_tok, t_l, True, backend=backend, index=index)
    return y, jnp.sum(send_tot - my_send), side


def exchange(kind: str, *args, overlap=None):
    """'padded' or 'ragged' (exchange_kind) -> that exchange's (y [Tl, M], overflow [],
    overlap() or None)."""
    return (ragged_exchange if kind == "ragged" else padded_exchange)(*args, overlap=overlap)
