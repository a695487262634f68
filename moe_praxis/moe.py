"""moe_block: router -> dispatch -> experts -> combine, ONE body with or without a mesh.

Letters: T tokens (all leading dims of x flattened), Tl = T / num_token_shards tokens of one
device (Tl = T without a mesh), M d_model, H d_ff (H / tp on one device), E experts,
El = E / ep experts of one EP rank, k top_k, R = Tl * k token copies of one device.

moe_block builds its EPLayout with resources.ep_bootstrap (the layout with no axes when
there is no mesh), resolves its Plan once (moe_praxis.plan: the backend, the exchange, the
dispatcher, the expert implementation and the combiner, each a registry entry chosen with its
reason) and runs `block_body` directly (no mesh) or under one jax.shard_map. With no axes
every collective is the identity, so the body is the single-device block. The body asks no
question about implementations: route -> dispatch -> experts -> combine, each stage what the
plan holds. Per device (docs/parallelism.md has the picture):
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
from moe_praxis.experts import FP8_WEIGHTS
from moe_praxis.ops import resolve_backend, vma
from moe_praxis.plan import Plan, layout_widths, resolve_plan
from moe_praxis.params import check_params, init_moe_params, param_shapes
from moe_praxis.resources import EPLayout, check_mesh_in_scope, ep_bootstrap, psum
from moe_praxis.shared import gather_shared_weights, shared_ffn

__all__ = [
    "MoEOutput", "Plan", "block_body", "check_params", "init_moe_params", "moe_block",
    "param_shapes", "resolve_plan", "sharded_fn"
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
    # static: ((expert weight, ops.fp8.rule.Fp8Gemms), ...) of the GEMMs this call ran in FP8
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


def _regrouped_experts(rows, keys, row_weights, *, weights, plan: Plan, num_local: int):
    """The experts on exchanged rows: rows [N, M]; keys [N] local expert (El = empty slot);
    row_weights: optional [N] routing weights multiplied into the activation -> [N, M]
    outputs in the same slots (zeros for empty slots)."""
    rows = vma.vary(rows, tuple(vma.varying_axes(weights["wo"])))
    perm, group_sizes, inv = exchange.regroup(keys, num_local, backend=plan.backend)
    grouped = plan.dispatcher.entry.regrouped(rows, perm)
    if row_weights is not None:
        row_weights = vma.vary(row_weights, tuple(vma.varying_axes(rows)))[perm]
    out = plan.experts.entry.run(grouped,
                                 group_sizes,
                                 weights,
                                 plan.config,
                                 backend=plan.backend,
                                 row_weights=row_weights)
    return out[inv]


def _local_experts(x, r, d, w_sorted, weights, *, plan: Plan, layout: EPLayout, shared_branch):
    """ep size 1: dispatch -> experts -> combine on this device -> (y [Tl, M], overflow 0,
    the shared branch's output or None)."""
    t_l = x.shape[0]
    index = sort.dispatch_index(d, t_l, backend=plan.backend)  # one for all permutes
    w_axes = tuple(vma.varying_axes(weights["wo"]))
    rows = plan.dispatcher.entry.run(x, d, index, backend=plan.backend, axes=w_axes)
    combiner = plan.combiner.entry
    row_w = vma.vary(w_sorted, rows.varying_axes()) if combiner.weights_in_rows else None
    out = plan.experts.entry.run(rows,
                                 d.group_sizes,
                                 weights,
                                 plan.config,
                                 backend=plan.backend,
                                 row_weights=row_w)
    y = combiner.run(out,
                     d,
                     weights=r.weights,
                     w_sorted=w_sorted,
                     num_tokens=t_l,
                     index=index,
                     backend=plan.backend,
                     tp=bool(layout.tp_axes))
    return y, jnp.zeros((), jnp.int32), shared_branch()


def _exchanged_experts(x, r, d, w_sorted, weights, *, plan: Plan, layout: EPLayout, shared_branch):
    """ep size > 1: the exchange to the owning ranks, the experts on the regrouped rows, the
    exchange back and its combine -> (y [Tl, M], overflow [], the shared branch's output or
    None). The shared branch needs only the local tokens: issued while the dispatched rows are
    in flight (after the exchange is issued, before the experts consume its rows), its GEMMs
    can hide the exchange's latency instead of waiting behind it."""
    del r
    experts = functools.partial(_regrouped_experts,
                                weights=weights,
                                plan=plan,
                                num_local=layout.experts_per_rank)
    send_mat = d.group_sizes.reshape(layout.ep_size, layout.experts_per_rank)
    return exchange.exchange(plan.exchange,
                             x,
                             d.row_map,
                             w_sorted,
                             send_mat,
                             layout,
                             plan.config,
                             experts,
                             plan.backend,
                             overlap=shared_branch)


# The dispatch -> experts -> combine path of each Plan.exchange.
_PATHS = {"none": _local_experts, "padded": _exchanged_experts, "ragged": _exchanged_experts}


def block_body(params, x, valid, *, plan: Plan, layout: EPLayout, seq_len, t_global: int):
    """The whole block on one device's tokens (under shard_map, or alone without a mesh):
    route -> dispatch -> experts -> combine, each stage what `plan` chose (moe_praxis.plan).

    params: this device's shards of the parameters (layout.weight_specs); x: [Tl, M]; valid:
    [Tl] bool; t_global: T. Returns (y [Tl, M] in x.dtype, aux_loss, z_loss,
    tokens_per_expert [E], dropped_tokens, router_entropy).
    """
    config, backend = plan.config, plan.backend
    token_axes = layout.token_axes
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
        y, overflow, shared = _PATHS[plan.exchange](x,
                                                    r,
                                                    d,
                                                    w_sorted,
                                                    weights,
                                                    plan=plan,
                                                    layout=layout,
                                                    shared_branch=shared_branch)
        if shared is not None:  # float32 sum; both are partial sums over tp
            y, shared = vma.vary_together(y.astype(jnp.float32), shared)
            y = y + shared
        y = psum(y, layout.tp_axes).astype(x.dtype)
    dropped = d.dropped_tokens + psum(overflow.astype(jnp.int32), token_axes)
    return (y, stats.aux_loss, stats.z_loss, stats.tokens_per_expert, dropped, stats.router_entropy)


def sharded_fn(config: MoEConfig,
               layout: EPLayout,
               mesh,
               *,
               kind: str,
               seq_len,
               t_global: int,
               param_names,
               backend: str,
               param_specs=None,
               plan: Optional[Plan] = None):
    """block_body under one shard_map over `mesh`: (params, x2 [T, M], valid [T]) -> (y [T, M],
    aux_loss, z_loss, tokens_per_expert [E], dropped_tokens, router_entropy). `kind` is the
    exchange, 'ragged' or 'padded'; param_names: the keys of the parameter tree; param_specs:
    its PartitionSpec tree where it holds more than arrays (the FP8 form of weights); plan:
    the call's Plan (None: resolved from the arguments of the first call, with `kind` and
    `backend`)."""
    specs = layout.weight_specs
    if param_specs is None:
        param_specs = {name: specs[name] for name in param_names}
    tok = layout.token_spec

    def fn(params, x2, valid):
        p = plan or resolve_plan(
            config, x2, params, layout=layout, backend=backend, exchange_kind=kind)
        body = functools.partial(block_body,
                                 plan=p,
                                 layout=layout,
                                 seq_len=seq_len,
                                 t_global=t_global)
        return jax.shard_map(body,
                             mesh=mesh,
                             in_specs=(param_specs, P(*tok, None), tok),
                             out_specs=(P(*tok, None), P(), P(), P(None), P(), P()),
                             check_vma=True)(params, x2, valid)

    return fn


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
    layout = ep_bootstrap(mesh, resources, config.num_experts, **layout_widths(config))
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
    plan = resolve_plan(config, x2, params, mesh=mesh, backend=backend, layout=layout)
    if mesh is None:
        fn = functools.partial(block_body, plan=plan, layout=layout, seq_len=seq_len, t_global=t)
    else:
        fn = sharded_fn(plan.config,
                        layout,
                        mesh,
                        kind=plan.exchange,
                        seq_len=seq_len,
                        t_global=t,
                        param_names=tuple(params),
                        backend=backend,
                        param_specs=specs,
                        plan=plan)
    y, aux, zl, counts, dropped, ent = fn(params, x2, valid)
    return MoEOutput(y=_unflatten(y, x, mesh, layout).astype(x.dtype),
                     aux_loss=aux,
                     z_loss=zl,
                     tokens_per_expert=counts,
                     dropped_tokens=dropped,
                     router_entropy=ent,
                     fp8_gemms=plan.fp8_gemms)
