"""moe_block: router -> dispatch -> experts -> combine, ONE body with or without a mesh.

Letters: T tokens (all leading dims of x flattened), Tl = T / num_token_shards tokens of one
device (Tl = T without a mesh), M d_model, H d_ff (H / tp on one device), E experts,
El = E / ep experts of one EP rank, k top_k, R = Tl * k token copies of one device.

moe_block builds its EPLayout with resources.ep_bootstrap (the layout with no axes when
there is no mesh) and runs `block_body` directly (no mesh) or under one jax.shard_map. With
no axes every collective is the identity, so the body is the single-device block. Per device
(docs/parallelism.md has the picture):
  1. Router on the local tokens; its statistics are reduced over ALL token axes, so aux
     loss, z-loss, tokens_per_expert and router entropy equal the single-device values on the
     global batch (router_stats).
  2. Capacity (optional): capacity(T) of the global batch with global priority, so the keep
     mask is exactly the single-device one (dispatch.capacity). Token rows never travel for
     this.
  3. Local sort of the R copies by expert (dispatch.sort); the copies of EP rank r's experts
     are contiguous.
  4. ep size 1: the sorted rows go straight to the experts. Otherwise the exchange to the
     owning rank and back (dispatch.exchange), the received rows regrouped by local expert.
  5. Experts: grouped GEMMs with the expert weights all-gathered over fsdp (their gradients
     are reduce-scattered by autodiff; moe_praxis.expert_weights), tp partial sums.
  6. Combine into [Tl, M]: a plain unpermute when the routing weights went into the
     activation (no tp), else the float32 weighted sum.
  7. Shared experts (config.num_shared_experts, moe_praxis.shared): a dense FFN of the local
     tokens added in float32 to the routed output; under EP issued between the dispatch
     exchange and the experts that consume it, so it can overlap the exchange. psum over tp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_praxis import expert_weights, router_stats, routing
from moe_praxis.config import MoEConfig
from moe_praxis.dispatch import capacity, exchange, sort
from moe_praxis.experts import (FP8_GATHER, FP8_WEIGHTS, expert_ffn, fp8_kernels, gathers_rows,
                                reads_rows_twice)
from moe_praxis.ops import resolve_backend, vma
from moe_praxis.params import check_params, init_moe_params, param_shapes
from moe_praxis.resources import EPLayout, check_mesh_in_scope, ep_bootstrap, psum
from moe_praxis.shared import gather_shared_weights, shared_ffn

__all__ = [
    "MoEOutput", "block_body", "check_params", "init_moe_params", "moe_block", "param_shapes",
    "sharded_fn"
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
    y: jax.Array  # [..., M] same shape and dtype as x
    aux_loss: jax.Array  # [] float32, coefficient applied
    z_loss: jax.Array  # [] float32, coefficient applied
    tokens_per_expert: jax.Array  # [E] int32 token copies the router assigned (before drops)
    dropped_tokens: jax.Array  # [] int32 copies dropped by the capacity or an EP buffer bound
    router_entropy: jax.Array  # [] float32 mean entropy of softmax(logits), no gradient
    # static: ((expert weight, ops.fp8_rule.Fp8Gemms), ...) of the GEMMs this call ran in FP8
    # (expert_weights.fp8_for_call; () without config.fp8)
    fp8_gemms: tuple = dataclasses.field(default=(), metadata=dict(static=True))


def _placed(a, shape, mesh, layout: EPLayout, spec):
    """a reshaped to `shape`; on a mesh with Explicit axes also given the sharding `spec` on
    them in its type (shard_map checks an input's type against its in_specs there; a plain
    reshape of a sharded type may be refused, so the reshape names its output sharding)."""
    if not layout.explicit_axes:
        return a.reshape(shape)
    sharding = NamedSharding(mesh, layout.explicit_spec(spec))
    return jax.sharding.reshard(jnp.reshape(a, shape, out_sharding=sharding), sharding)


def _unflatten(y, x, mesh, layout: EPLayout):
    """y [T, M] -> x's shape; with Explicit axes, x's type's sharding (replicated over the mesh
    when x's type has none, e.g. a plain array outside jax.set_mesh)."""
    if mesh is None or not layout.explicit_axes:
        return y.reshape(x.shape)
    target = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(target, NamedSharding) or target.mesh.empty:
        target = NamedSharding(mesh, P())
    return jax.sharding.reshard(jnp.reshape(y, x.shape, out_sharding=target), target)


def _flatten(x, paddings, config: MoEConfig, layout: EPLayout, place):
    """(x [T, M], valid [T], seq_len), checked, then placed by `place(a, shape, rows)` on the
    token spec (rows: a has the d_model dimension)."""
    if x.ndim < 1 or x.shape[-1] != config.d_model:
        raise ValueError(f"x must be [..., d_model={config.d_model}], got shape {x.shape}")
    if paddings is not None and paddings.shape != x.shape[:-1]:
        raise ValueError(f"paddings must have shape x.shape[:-1]={x.shape[:-1]}, "
                         f"got {paddings.shape}")
    t = math.prod(x.shape[:-1])
    seq_len = x.shape[-2] if x.ndim >= 3 else None
    _check_token_shards(t, layout, config, seq_len)
    x2 = place(x, (t, config.d_model), True)
    if paddings is None:
        valid = place(jnp.ones((t, ), bool), (t, ), False)
    else:
        valid = place(paddings, (t, ), False) < 0.5
    return x2, valid, seq_len


def _regrouped_experts(rows, keys, row_weights, *, weights, config: MoEConfig, num_local: int,
                       backend: str):
    """The experts on exchanged rows: rows [N, M]; keys [N] local expert (El = empty slot);
    row_weights: optional [N] routing weights multiplied into the activation -> [N, M]
    outputs in the same slots (zeros for empty slots)."""
    rows = vma.vary(rows, tuple(vma.varying_axes(weights["wo"])))
    perm, group_sizes, inv = exchange.regroup(keys, num_local, backend=backend)
    grouped = tokens = None
    if gathers_rows(config, rows, weights, backend):  # the projections read rows[perm] by index
        tokens = (rows, perm, None)
    else:
        grouped = checkpoint_name(rows[perm], "moe_dispatched")
    if row_weights is not None:
        row_weights = vma.vary(row_weights, tuple(vma.varying_axes(rows)))[perm]
    out = expert_ffn(grouped,
                     group_sizes,
                     weights,
                     config,
                     backend=backend,
                     row_weights=row_weights,
                     tokens=tokens)
    return out[inv]


def block_body(params, x, valid, *, config: MoEConfig, layout: EPLayout, kind: str, seq_len,
               t_global: int, backend: str):
    """The whole block on one device's tokens (under shard_map, or alone without a mesh).

    params: this device's shards of the parameters (layout.weight_specs); x: [Tl, M]; valid:
    [Tl] bool; kind: the exchange ('padded' | 'ragged'); t_global: T; backend: the resolved
    kernel backend ('xla' | 'cuda'). Returns (y [Tl, M] in x.dtype, aux_loss, z_loss,
    tokens_per_expert [E], dropped_tokens, router_entropy).
    """
    token_axes = layout.token_axes
    t_l = x.shape[0]
    shard = jax.lax.axis_index(token_axes) if token_axes else 0

    with jax.named_scope("moe_router"):
        logits = checkpoint_name(routing.router_logits(x, params["router"], config),
                                 "moe_router_logits")
        r = routing.route_logits(logits, config, params.get("expert_bias"), backend=backend)
        stats = router_stats.router_statistics(r,
                                               logits,
                                               valid,
                                               config,
                                               token_axes=token_axes,
                                               seq_len=seq_len,
                                               t_global=t_global,
                                               backend=backend)

    with jax.named_scope("moe_dispatch"):
        keep, cap_dropped = capacity.global_keep(r.expert_ids,
                                                 r.weights,
                                                 valid,
                                                 config,
                                                 layout,
                                                 shard,
                                                 t_global,
                                                 backend=backend)
        d = sort.sort_copies(r.expert_ids, keep, config.num_experts, cap_dropped, backend=backend)
        w_sorted = sort.row_weights(r.weights, d)  # [R] float32

    shared_weights = gather_shared_weights(params, layout)

    def shared_branch():
        if not shared_weights:
            return None
        with jax.named_scope("moe_shared_experts"):
            return shared_ffn(x, valid, shared_weights, config, backend=backend)

    with jax.named_scope("moe_experts"):
        weights = expert_weights.gather_expert_weights(params, layout, config)
        if layout.ep_size == 1:
            rows = rows_fp8 = rows_up = tokens = None
            index = sort.dispatch_index(d, t_l, backend=backend)  # one for all permutes
            w_axes = tuple(vma.varying_axes(weights["wo"]))
            if gathers_rows(config, x, weights, backend):  # the projections read x by index
                tokens = (vma.vary(x, w_axes), d.row_map, index)
            elif fp8_kernels(config, backend) and FP8_GATHER not in weights:  # the permute
                # writes the rows' FP8 operand too
                rows, rows_fp8 = sort.dispatch_rows_fp8(x, d)
            elif reads_rows_twice(config):  # the gate and up projections' cotangents are summed
                # in the permute's backward
                rows, rows_up = sort.dispatch_rows_pair(x, d, backend=backend, index=index)
            else:
                rows = sort.dispatch_rows(x, d, backend=backend, index=index)
            if rows is not None:
                rows = vma.vary(checkpoint_name(rows, "moe_dispatched"), w_axes)
            if rows_up is not None:
                rows_up = vma.vary(checkpoint_name(rows_up, "moe_dispatched"), w_axes)
            if rows_fp8 is not None:
                rows_fp8 = tuple(vma.vary(a, w_axes) for a in rows_fp8)
            # Without tensor parallelism the routing weights go into the activation and the
            # combine is a plain unpermute; with it, the partial sums over tp are added in
            # float32 after a float32 weighted combine.
            fuse = exchange.fuse_weights(layout)
            gather = config.gather_combine  # the weights go into the combine instead
            lhs = rows if tokens is None else tokens[0]
            row_w = vma.vary(w_sorted, tuple(vma.varying_axes(lhs))) if fuse and not gather \
                else None
            out = expert_ffn(rows,
                             d.group_sizes,
                             weights,
                             config,
                             backend=backend,
                             row_weights=row_w,
                             rows_fp8=rows_fp8,
                             rows_up=rows_up,
                             tokens=tokens)
            if gather:  # float32 where tp partial sums are added after it, as below
                y = sort.combine_gather(out,
                                        vma.vary(r.weights, tuple(vma.varying_axes(out))),
                                        d,
                                        t_l,
                                        out.dtype if fuse else jnp.float32,
                                        backend=backend)
            else:
                y = sort.combine_sorted(out,
                                        w_sorted,
                                        d.row_map,
                                        t_l,
                                        not fuse,
                                        backend=backend,
                                        index=index)
            overflow = jnp.zeros((), jnp.int32)
            shared = shared_branch()
        else:
            experts = functools.partial(_regrouped_experts,
                                        weights=weights,
                                        config=config,
                                        num_local=layout.experts_per_rank,
                                        backend=backend)
            send_mat = d.group_sizes.reshape(layout.ep_size, layout.experts_per_rank)
            # The shared branch needs only the local tokens: issued while the dispatched rows
            # are in flight (after the exchange is issued, before the experts consume its
            # rows), its GEMMs can hide the exchange's latency instead of waiting behind it.
            y, overflow, shared = exchange.exchange(kind,
                                                    x,
                                                    d.row_map,
                                                    w_sorted,
                                                    send_mat,
                                                    layout,
                                                    config,
                                                    experts,
                                                    backend,
                                                    overlap=shared_branch)
        if shared is not None:  # float32 sum; both are partial sums over tp
            y, shared = vma.vary_together(y.astype(jnp.float32), shared)
            y = y + shared
        y = psum(y, layout.tp_axes).astype(x.dtype)
    dropped = d.dropped_tokens + psum(overflow.astype(jnp.int32), token_axes)
    return (y, stats.aux_loss, stats.z_loss, stats.tokens_per_expert, dropped, stats.router_entropy)


def _bound_body(config: MoEConfig, layout: EPLayout, *, kind: str, seq_len, t_global: int,
                backend: str):
    """block_body with its static arguments bound: (params, x2, valid) -> the six outputs."""
    return functools.partial(block_body,
                             config=config,
                             layout=layout,
                             kind=kind,
                             seq_len=seq_len,
                             t_global=t_global,
                             backend=backend)


def sharded_fn(config: MoEConfig,
               layout: EPLayout,
               mesh,
               *,
               kind: str,
               seq_len,
               t_global: int,
               param_names,
               backend: str,
               param_specs=None):
    """block_body under one shard_map over `mesh`: (params, x2 [T, M], valid [T]) -> (y [T, M],
    aux_loss, z_loss, tokens_per_expert [E], dropped_tokens, router_entropy). `kind` is the
    exchange, 'ragged' or 'padded'; param_names: the keys of the parameter tree; param_specs:
    its PartitionSpec tree where it holds more than arrays (the FP8 form of weights)."""
    specs = layout.weight_specs
    if param_specs is None:
        param_specs = {name: specs[name] for name in param_names}
    tok = layout.token_spec
    body = _bound_body(config,
                       layout,
                       kind=kind,
                       seq_len=seq_len,
                       t_global=t_global,
                       backend=backend)
    return jax.shard_map(body,
                         mesh=mesh,
                         in_specs=(param_specs, P(*tok, None), tok),
                         out_specs=(P(*tok, None), P(), P(), P(None), P(), P()),
                         check_vma=True)


def _check_token_shards(t: int, layout: EPLayout, config: MoEConfig, seq_len) -> None:
    n = layout.num_token_shards
    if t % n:
        raise ValueError(f"{t} tokens (all leading dims of x) are not divisible by the "
                         f"{n} token shards (dp x fsdp x ep = {layout.dp_size} x "
                         f"{layout.fsdp_size} x {layout.ep_size}); pad the batch to a "
                         f"multiple of {n} and mark the padding in `paddings`")
    if config.aux_loss_type == "sequence" and layout.token_axes:
        if seq_len is None:
            raise ValueError("aux_loss_type='sequence' needs x of shape [..., S, d_model]")
        if (t // n) % seq_len:
            raise ValueError(f"aux_loss_type='sequence' under expert parallelism needs whole "
                             f"sequences per token shard: {t // n} tokens per shard is not a "
                             f"multiple of seq_len={seq_len}")


def moe_block(params: dict,
              x,
              config: MoEConfig,
              *,
              mesh=None,
              resources=None,
              paddings: Optional[jax.Array] = None) -> MoEOutput:
    """The MoE feed-forward block.

    params: see init_moe_params; optionally with the expert weights' FP8 form made beforehand
    (quantize_expert_weights, config.fp8 set): the FP8 GEMMs then read it and quantize no
    weight (bitwise the same results). x: [..., M]. paddings: optional x.shape[:-1], 1 = padded
    (padded tokens route nowhere, output zeros and count in no statistic).
    mesh / resources: run expert-parallel over `mesh` with the roles in `resources`
    (moe_praxis.MeshResources); both None = one device.
    Returns MoEOutput (y has x's shape and dtype).
    """
    check_params({n: w for n, w in params.items() if n != FP8_WEIGHTS}, config)
    expert_weights.check_fp8_weights(params, config)
    backend = resolve_backend(config.kernel_backend, "moe_block")
    if (mesh is None) != (resources is None):
        raise ValueError("moe_block needs both mesh and resources for expert parallelism "
                         f"(got mesh={mesh!r}, resources={resources!r})")
    layout = ep_bootstrap(mesh,
                          resources,
                          config.num_experts,
                          d_model=config.d_model,
                          d_ff=config.d_ff,
                          shared_d_ff=config.shared_hidden)
    if mesh is not None:
        check_mesh_in_scope(mesh)
    tok = layout.token_spec
    x2, valid, seq_len = _flatten(
        x, paddings, config, layout, lambda a, shape, rows: _placed(a, shape, mesh, layout,
                                                                    P(*tok, None) if rows else tok))
    specs = expert_weights.param_specs(layout, params)
    if layout.explicit_axes:
        params = jax.tree.map(lambda w, spec: _placed(w, w.shape, mesh, layout, spec), params,
                              specs)
    t = x2.shape[0]
    config, fp8_gemms = expert_weights.fp8_for_call(
        config, params, expert_weights.rows_per_local_expert(t, layout, config.top_k))
    if mesh is None:
        kind = "padded"  # ep size 1: no exchange
        fn = _bound_body(config, layout, kind=kind, seq_len=seq_len, t_global=t, backend=backend)
    else:
        kind = exchange.checked_exchange_kind(config, mesh, layout.ep_size)
        fn = sharded_fn(config,
                        layout,
                        mesh,
                        kind=kind,
                        seq_len=seq_len,
                        t_global=t,
                        param_names=tuple(params),
                        backend=backend,
                        param_specs=specs)
    y, aux, zl, counts, dropped, ent = fn(params, x2, valid)
    return MoEOutput(y=_unflatten(y, x, mesh, layout).astype(x.dtype),
                     aux_loss=aux,
                     z_loss=zl,
                     tokens_per_expert=counts,
                     dropped_tokens=dropped,
                     router_entropy=ent,
                     fp8_gemms=tuple(fp8_gemms.items()))
