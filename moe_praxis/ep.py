"""Expert-parallel moe_block: the whole block in one shard_map.

Letters: T global tokens, Tl = T / num_token_shards tokens of one device, M d_model, H d_ff
(H / tp on one device), E experts, El = E / ep experts of one EP rank, k top_k,
R = Tl * k token copies of one device, ep the EP group size.

Per device (see docs/parallelism.md for the picture):
  1. Router on the local tokens; load statistics (tokens per expert, valid-token count) are
     psum-ed over ALL token axes, so aux loss, z-loss and tokens_per_expert equal the
     single-device values on the global batch (each shard adds its share of the loss with
     the GLOBAL counts, then the shares are summed).
  2. Capacity (optional): capacity(T) of the global batch and global priority, so the keep
     mask is exactly the single-device one: 'position' from all-gathered per-shard counts
     [k, E]; 'weight' from the routing decisions (ids, weights [T, k]) all-gathered over
     the token axes. Token rows never travel for this.
  3. Local sort of the R copies by expert; the copies of EP rank r's experts are contiguous.
  4. Exchange to the owning rank: 'padded' (one all_to_all of a [ep, C, M] buffer each way)
     or 'ragged' (one jax.lax.ragged_all_to_all each way into a [B, M] buffer). Defaults:
     C = R (a device may send all its copies to one rank) and B = ep * R (a rank may receive
     all copies of its group), so dropless stays dropless. MoEConfig.ep_buffer_factor = f
     bounds them to C = ceil(f * R / ep), B = ceil(f * R) (f x the balanced load); copies
     past the bound are not sent, count in dropped_tokens and contribute zero.
  5. Regroup the received rows by local expert (stable: source rank, then source order),
     grouped GEMMs with the expert weights all-gathered over fsdp (their gradients are
     reduce-scattered by autodiff), tp partial sums.
  6. The mirror exchange back, the weighted combine into [Tl, M], psum over tp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_praxis import dispatch as dispatch_lib
from moe_praxis import ops, routing
from moe_praxis.config import MoEConfig
from moe_praxis.experts import expert_ffn
from moe_praxis.ops import vma
from moe_praxis.resources import EPLayout, MeshResources, ep_bootstrap

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


def exchange_kind(config: MoEConfig, mesh) -> str:
    """'ragged' or 'padded': config.ep_exchange, with 'auto' resolved by the mesh platform
    (ragged_all_to_all on GPU / TPU; XLA:CPU has none, so padded there)."""
    if config.ep_exchange != "auto":
        return config.ep_exchange
    return "ragged" if mesh_platform(mesh) in RAGGED_PLATFORMS else "padded"


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


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


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


def _experts(rows, keys, w, config, num_local, backend, row_weights=None):
    """rows: [N, M] received rows; keys: [N] local expert (El = invalid) -> [N, M] outputs
    in the same slots (zeros for invalid rows). row_weights: optional [N] routing weights of
    the rows, multiplied into the activation (expert_ffn)."""
    rows = _vary(rows, tuple(_varying_axes(w["wo"])))
    perm = jnp.argsort(keys, stable=True)
    group_sizes = jnp.bincount(keys, length=num_local + 1)[:num_local].astype(jnp.int32)
    grouped = checkpoint_name(rows[perm], "moe_dispatched")
    if row_weights is not None:
        row_weights = _vary(row_weights, tuple(_varying_axes(rows)))[perm]
    out = expert_ffn(grouped, group_sizes, w, config, backend=backend, row_weights=row_weights)
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    return out[inv]


def _fuse_weights(layout) -> bool:
    """Whether the routing weights are multiplied into the experts' activation (the SwiGLU
    kernel's fused weight) and the combine is a plain unpermute in the rows' dtype: yes unless
    tensor parallelism adds partial sums after the combine (then it stays float32, weighted
    after the return trip). (The 'ragged' exchange never does: moving the weights there takes
    a second ragged_all_to_all, 7 ms more per step on 2 H200s with jax 0.11.2.)"""
    return not layout.tp_axes


def _combine(rows, w_rows, row_map, num_tokens, weighted: bool, backend):
    """[R, M] expert outputs -> [Tl, M]: a plain unpermute when the routing weights are
    already in the rows (weighted=False), else the float32 weighted sum."""
    if weighted:
        rows = rows.astype(jnp.float32) * w_rows[:, None]
    return ops.unpermute(rows, row_map, num_tokens, backend=backend)


def _padded_exchange(x, row_tok, w_sorted, send_mat, layout, config, weights, backend):
    """One all_to_all of a [ep, C, M] buffer each way. Returns (y [Tl, M], overflow): y in
    float32 where tp partial sums follow (the weights applied after the return trip), else in
    the rows' dtype (the weights travel with the rows into the activation: _fuse_weights)."""
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
    send_buf = ops.permute(x, slot_tok, backend=backend).reshape(ep, cap, -1)
    recv_mat = jax.lax.all_to_all(send_mat, axes, 0, 0, tiled=True)  # [src, El]
    recv_buf = jax.lax.all_to_all(send_buf, axes, 0, 0, tiled=True)  # [src, C, M]
    recv_tot = jnp.minimum(jnp.sum(recv_mat, axis=1), cap)
    src = jnp.repeat(jnp.arange(ep, dtype=jnp.int32), cap)
    pos = jnp.tile(slot, ep)
    keys = _regroup_keys(src, pos, pos < recv_tot[src], recv_mat, el)
    fuse = _fuse_weights(layout)
    recv_w = None
    if fuse:  # [src, C] routing weights of the received rows (0 in empty slots)
        recv_w = jax.lax.all_to_all(slot_w.reshape(ep, cap), axes, 0, 0, tiled=True).reshape(-1)
    out = _experts(recv_buf.reshape(ep * cap, -1), keys, weights, config, el, backend, recv_w)
    back = jax.lax.all_to_all(out.reshape(ep, cap, -1), axes, 0, 0, tiled=True)  # [dst, C, M]
    y = _combine(back.reshape(ep * cap, -1), slot_w, slot_tok, t_l, not fuse, backend)
    return y, jnp.sum(send_tot - sent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ragged_move(rows, offsets, out_rows: int, axes, vary):
    """ragged_all_to_all of rows [N, M] into a fresh [out_rows, M] buffer.

    offsets: (fwd, bwd), each (input_offsets, send_sizes, output_offsets, recv_sizes) [ep]
    int32, bwd being the mirror move. The backward is that mirror ragged_all_to_all of the
    cotangent, with the offsets we already know (no generic transpose, no extra all_to_all
    of offsets). vary: the mesh axes rows vary over (shard_map's type of the results)."""
    fwd, _ = offsets
    buf = _vary(jnp.zeros((out_rows, ) + rows.shape[1:], rows.dtype), vary)
    return _vary(jax.lax.ragged_all_to_all(rows, buf, *fwd, axis_name=axes), vary)


def _ragged_move_fwd(rows, offsets, out_rows, axes, vary):
    return _ragged_move(rows, offsets, out_rows, axes, vary), (offsets, rows.shape[0])


def _ragged_move_bwd(out_rows, axes, vary, res, g):
    (fwd, bwd), n = res
    buf = _vary(jnp.zeros((n, ) + g.shape[1:], g.dtype), vary)
    g_rows = _vary(jax.lax.ragged_all_to_all(_vary(g, vary), buf, *bwd, axis_name=axes), vary)
    return g_rows, jax.tree.map(vma.zero_cotangent, (fwd, bwd))


_ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


def _ragged_exchange(x, row_tok, w_sorted, send_mat, layout, config, weights, backend):
    """One ragged_all_to_all each way into a [B, M] buffer. Returns (y [Tl, M] f32, overflow):
    the routing weights are applied after the return trip (see _fuse_weights)."""
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

    rows = ops.permute(x, row_tok, backend=backend)  # [R, M] expert-sorted
    recv_mat = jax.lax.all_to_all(send_mat, axes, 0, 0, tiled=True)  # [src, El]
    there = (nz(in_off[me], my_send), my_send, nz(out_off[me], my_send), my_recv)
    back_again = (nz(out_off[:, me], my_recv), my_recv, nz(in_off[:, me], my_recv), my_send)
    vary = tuple(sorted(_varying_axes(rows) | set(axes)))
    recv = _ragged_move(rows, (there, back_again), bound, axes, vary)  # [B, M]
    src, pos, in_range = _block_position(jnp.arange(bound, dtype=jnp.int32), my_recv)
    keys = _regroup_keys(src, pos, in_range, recv_mat, el)
    out = _experts(recv, keys, weights, config, el, backend)
    out = _vary(out, vary)
    back = _ragged_move(out, (back_again, there), r_rows, axes, vary)  # [R, M], 0 if dropped
    return _combine(back, w_sorted, row_tok, t_l, True, backend), jnp.sum(send_tot - my_send)


def _position_keep(ids, valid, config: MoEConfig, layout: EPLayout, shard, t_global):
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
        order = jnp.argsort(col, stable=True)
        srt = col[order]
        start = jnp.searchsorted(srt, jnp.arange(e + 1, dtype=col.dtype), side="left")
        return jnp.zeros_like(col).at[order].set(jnp.arange(t_l, dtype=col.dtype) - start[srt])

    rank = jax.vmap(rank_in_expert, in_axes=1, out_axes=1)(eid)  # [Tl, k]
    col = jnp.arange(k)[None, :]
    pos = before_j[col, eid] + before_s[col, eid] + rank
    return (pos < config.capacity(t_global)) & valid[:, None]


def _global_keep(ids, weights, valid, config: MoEConfig, layout: EPLayout, shard, t_global):
    """Capacity keep mask [Tl, k] equal to the single-device one, and the global drop count.

    'position': from all-gathered per-shard counts (_position_keep). 'weight': the routing
    decisions (ids and weights) are all-gathered over the token axes (in token-shard order,
    so row s * Tl + t is global token s * Tl + t), dispatch.capacity_keep runs on them with
    the global capacity(T), and each device slices its own rows."""
    axes = layout.token_axes
    if config.drop_policy == "position":
        keep = _position_keep(ids, valid, config, layout, shard, t_global)
        return keep, _psum(jnp.sum(valid[:, None] & ~keep, dtype=jnp.int32), axes)
    t_l = ids.shape[0]

    def gather(a):
        return jax.lax.all_gather(a, axes, axis=0, tiled=True) if axes else a

    ids_g = gather(ids)
    valid_g = gather(valid.astype(jnp.int32)) > 0
    w_g = gather(jax.lax.stop_gradient(weights))
    keep_g = dispatch_lib.capacity_keep(ids_g, w_g, valid_g, config, config.capacity(t_global))
    keep = jax.lax.dynamic_slice_in_dim(keep_g, shard * t_l, t_l, axis=0)
    dropped = _psum(jnp.sum(valid[:, None] & ~keep, dtype=jnp.int32), axes)
    return keep, dropped


_varying_axes = vma.varying_axes

# x marked varying over more axes: a custom_vjp grouped GEMM returns per-shard weight
# gradients, which autodiff of the cast sums back.
_vary = vma.vary


def _gather_weights(params, layout: EPLayout):
    """Expert weights all-gathered over fsdp: wi [El, M, H/tp], wo [El, H/tp, M], marked
    varying over the token and tp axes like the rows they multiply."""
    out = {}
    for name in ("wi_gate", "wi_up", "wi_gate_up", "wo"):
        if name not in params:
            continue
        w = params[name]
        if layout.fsdp_axes:
            if layout.fsdp_dim == "expert":
                dim = 0
            else:
                dim = 1 if name.startswith("wi") else 2
            w = jax.lax.all_gather(w, layout.fsdp_axes, axis=dim, tiled=True)
        out[name] = _vary(w, layout.token_axes + layout.tp_axes)
    return out


def _body(params, x, valid, *, config: MoEConfig, layout: EPLayout, kind, seq_len, t_global,
          backend):
    e, k = config.num_experts, config.top_k
    token_axes = layout.token_axes
    t_l = x.shape[0]
    shard = jax.lax.axis_index(token_axes) if token_axes else 0

    with jax.named_scope("moe_router"):
        logits = checkpoint_name(routing.router_logits(x, params["router"], config),
                                 "moe_router_logits")
        r = routing.route_logits(logits, config, params.get("expert_bias"), backend=backend)
        counts = _psum(routing.tokens_per_expert(r.expert_ids, e, valid), token_axes)
        n_valid = _psum(jnp.sum(valid.astype(jnp.int32)), token_axes)
        num_tokens = jnp.maximum(n_valid, 1)
        if config.aux_loss_type == "sequence":
            local = routing.load_balance_loss(r, config, valid, seq_len=seq_len, backend=backend)
            aux = _psum(local * (t_l // seq_len), token_axes) / (t_global // seq_len)
        else:
            if config.aux_loss_type == "gshard":
                f = _psum(routing.tokens_per_expert(r.expert_ids[:, :1], e, valid), token_axes)
            else:
                f = counts
            aux = _psum(
                routing.load_balance_loss(r,
                                          config,
                                          valid,
                                          counts=f,
                                          num_tokens=num_tokens,
                                          backend=backend), token_axes)
        zl = _psum(
            routing.z_loss(logits,
                           valid,
                           config.z_loss_coeff,
                           num_tokens=num_tokens.astype(jnp.float32)), token_axes)
        ent = _psum(
            routing.router_entropy(logits, valid, num_tokens=num_tokens.astype(jnp.float32)),
            token_axes)

    with jax.named_scope("moe_dispatch"):
        if config.capacity_factor is None:
            keep = jnp.broadcast_to(valid[:, None], (t_l, k))
            cap_dropped = jnp.zeros((), jnp.int32)
        else:
            keep, cap_dropped = _global_keep(r.expert_ids, r.weights, valid, config, layout, shard,
                                             t_global)
        flat_e = jnp.where(keep, r.expert_ids, e).reshape(-1).astype(jnp.int32)  # [R]
        order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
        sorted_e = flat_e[order]
        row_tok = jnp.where(sorted_e < e, order // k, t_l).astype(jnp.int32)  # [R]
        w_sorted = r.weights.reshape(-1)[order].astype(jnp.float32)
        group_sizes = jnp.bincount(flat_e, length=e + 1)[:e].astype(jnp.int32)  # [E]

    with jax.named_scope("moe_experts"):
        weights = _gather_weights(params, layout)
        if layout.ep_size == 1:
            rows = checkpoint_name(ops.permute(x, row_tok, backend=backend), "moe_dispatched")
            rows = _vary(rows, tuple(_varying_axes(weights["wo"])))
            # Without tensor parallelism the routing weights go into the activation and the
            # combine is a plain unpermute (as in moe_block without a mesh); with it, the
            # partial sums over tp are added in float32 after a float32 weighted combine.
            fuse_weights = _fuse_weights(layout)
            out = expert_ffn(
                rows,
                group_sizes,
                weights,
                config,
                backend=backend,
                row_weights=_vary(w_sorted, tuple(_varying_axes(rows))) if fuse_weights else None)
            y = _combine(out, w_sorted, row_tok, t_l, not fuse_weights, backend)
            overflow = jnp.zeros((), jnp.int32)
        else:
            send_mat = group_sizes.reshape(layout.ep_size, layout.experts_per_rank)
            exchange = _ragged_exchange if kind == "ragged" else _padded_exchange
            y, overflow = exchange(x, row_tok, w_sorted, send_mat, layout, config, weights, backend)
        y = _psum(y, layout.tp_axes).astype(x.dtype)
    dropped = cap_dropped + _psum(overflow.astype(jnp.int32), token_axes)
    return y, aux, zl, counts, dropped, ent


def sharded_fn(config: MoEConfig, layout: EPLayout, mesh, *, kind: str, seq_len, t_global: int,
               param_names, backend: str):
    """The shard_map-ed block: (params, x2 [T, M], valid [T]) -> (y [T, M], aux_loss, z_loss,
    tokens_per_expert [E], dropped_tokens). `kind` is the exchange, 'ragged' or 'padded'."""
    specs = layout.weight_specs
    tok = layout.token_spec
    body = functools.partial(_body,
                             config=config,
                             layout=layout,
                             kind=kind,
                             seq_len=seq_len,
                             t_global=t_global,
                             backend=backend)
    return jax.shard_map(body,
                         mesh=mesh,
                         in_specs=({
                             name: specs[name]
                             for name in param_names
                         }, P(*tok, None), tok),
                         out_specs=(P(*tok, None), P(), P(), P(None), P(), P()),
                         check_vma=True)


def moe_sharded(params, x2, valid, config: MoEConfig, *, mesh, resources: MeshResources, seq_len,
                backend):
    """The MoE block expert-parallel over `mesh` with the roles in `resources`.

    params: full (global) parameter arrays; x2: [T, M]; valid: [T] bool (False = padded).
    T must be divisible by dp * fsdp * ep. Returns moe_praxis.moe.MoEOutput with y [T, M].
    """
    from moe_praxis.moe import MoEOutput  # moe imports this module lazily

    layout = ep_bootstrap(mesh,
                          resources,
                          config.num_experts,
                          d_model=config.d_model,
                          d_ff=config.d_ff)
    t = x2.shape[0]
    n = layout.num_token_shards
    if t % n:
        raise ValueError(f"{t} tokens (all leading dims of x) are not divisible by the "
                         f"{n} token shards (dp x fsdp x ep = {layout.dp_size} x "
                         f"{layout.fsdp_size} x {layout.ep_size}); pad the batch to a "
                         f"multiple of {n} and mark the padding in `paddings`")
    t_l = t // n
    if config.aux_loss_type == "sequence":
        if seq_len is None:
            raise ValueError("aux_loss_type='sequence' needs x of shape [..., S, d_model]")
        if t_l % seq_len:
            raise ValueError(f"aux_loss_type='sequence' under expert parallelism needs whole "
                             f"sequences per token shard: {t_l} tokens per shard is not a "
                             f"multiple of seq_len={seq_len}")
    kind = exchange_kind(config, mesh)
    if kind == "ragged" and mesh_platform(mesh) not in RAGGED_PLATFORMS:
        raise ValueError(f"MoEConfig.ep_exchange='ragged' needs jax.lax.ragged_all_to_all, which "
                         f"XLA on platform {mesh_platform(mesh)!r} cannot compile; use "
                         "ep_exchange='padded' (or 'auto', which picks it there)")
    fn = sharded_fn(config,
                    layout,
                    mesh,
                    kind=kind,
                    seq_len=seq_len,
                    t_global=t,
                    param_names=tuple(params),
                    backend=backend)
    y, aux, zl, counts, dropped, ent = fn(params, x2, valid)
    return MoEOutput(y=y,
                     aux_loss=aux,
                     z_loss=zl,
                     tokens_per_expert=counts,
                     dropped_tokens=dropped,
                     router_entropy=ent)
