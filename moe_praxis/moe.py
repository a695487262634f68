"""moe_block: router -> dispatch -> experts -> combine.

Letters: T tokens (all leading dims of x flattened), M d_model, H d_ff, E experts, k top_k.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_praxis import dispatch as dispatch_lib
from moe_praxis import ops
from moe_praxis import routing
from moe_praxis.config import MoEConfig
from moe_praxis.experts import expert_ffn
from moe_praxis.ops import resolve_backend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
    y: jax.Array  # [..., M] same shape and dtype as x
    aux_loss: jax.Array  # [] float32, coefficient applied
    z_loss: jax.Array  # [] float32, coefficient applied
    tokens_per_expert: jax.Array  # [E] int32 token copies the router assigned (before drops)
    dropped_tokens: jax.Array  # [] int32 copies dropped by the capacity or an EP buffer bound
    router_entropy: jax.Array  # [] float32 mean entropy of softmax(logits), no gradient


def param_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """The parameter tree's shapes: the contract between init, the layer and converters."""
    m, h, e = config.d_model, config.d_ff, config.num_experts
    shapes = {"router": (m, e), "wo": (e, h, m)}
    if config.fuse_gate_up:
        shapes["wi_gate_up"] = (e, m, 2 * h)  # gate / up columns interleaved (ops.gate_up)
    else:
        shapes["wi_up"] = (e, m, h)
        if config.gated:
            shapes["wi_gate"] = (e, m, h)
    if config.use_expert_bias:
        shapes["expert_bias"] = (e, )
    return shapes


def init_moe_params(key, config: MoEConfig, dtype=jnp.float32) -> dict:
    """Random parameters: normal(0, scale / sqrt(fan_in)); expert_bias zeros.

    Keys: router [M, E], wi_gate [E, M, H] (gated only), wi_up [E, M, H], wo [E, H, M],
    expert_bias [E] (use_expert_bias only); with fuse_gate_up, wi_gate_up [E, M, 2H] instead of
    wi_gate and wi_up (each interleaved half drawn as they are: fan_in M).
    """
    shapes = param_shapes(config)
    keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
    params = {}
    for name, shape in shapes.items():
        if name == "expert_bias":
            params[name] = jnp.zeros(shape, dtype)
            continue
        fan_in = shape[-2]
        std = config.param_init_scale / math.sqrt(fan_in)
        params[name] = (std * jax.random.normal(keys[name], shape, jnp.float32)).astype(dtype)
    return params


def check_params(params: dict, config: MoEConfig) -> None:
    """Raises ValueError naming any missing, unexpected or mis-shaped parameter."""
    want = param_shapes(config)
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(
            f"MoE params do not match the config: missing {missing}, unexpected {extra} "
            f"(gated={config.gated}, fuse_gate_up={config.fuse_gate_up}, "
            f"use_expert_bias={config.use_expert_bias})")
    for name, shape in want.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"MoE param {name!r} has shape {tuple(params[name].shape)}; "
                             f"the config needs {shape}")


def _flatten(x, paddings, config: MoEConfig):
    if x.ndim < 1 or x.shape[-1] != config.d_model:
        raise ValueError(f"x must be [..., d_model={config.d_model}], got shape {x.shape}")
    x2 = x.reshape(-1, config.d_model)
    if paddings is None:
        valid = jnp.ones((x2.shape[0], ), bool)
    else:
        if paddings.shape != x.shape[:-1]:
            raise ValueError(f"paddings must have shape x.shape[:-1]={x.shape[:-1]}, "
                             f"got {paddings.shape}")
        valid = paddings.reshape(-1) < 0.5
    seq_len = x.shape[-2] if x.ndim >= 3 else None
    return x2, valid, seq_len


def moe_local(params, x2, valid, config: MoEConfig, *, seq_len=None, backend="xla"):
    """The whole block on one device's tokens. x2: [T, M]; valid: [T] bool -> MoEOutput."""
    t = x2.shape[0]
    logits = checkpoint_name(routing.router_logits(x2, params["router"], config),
                             "moe_router_logits")
    r = routing.route_logits(logits, config, params.get("expert_bias"), backend=backend)
    counts = routing.tokens_per_expert(r.expert_ids, config.num_experts, valid)
    aux = routing.load_balance_loss(r, config, valid, seq_len=seq_len, backend=backend)
    zl = routing.z_loss(logits, valid, config.z_loss_coeff)
    ent = routing.router_entropy(logits, valid)
    d = dispatch_lib.make_dispatch(r.expert_ids, r.weights, valid, config)
    rows = checkpoint_name(dispatch_lib.dispatch_rows(x2, d, backend=backend), "moe_dispatched")
    # The routing weights go into the activation (the SwiGLU kernel's fused multiply), so the
    # combine is a plain unpermute of the expert outputs (summed in float32, rounded once).
    out_rows = expert_ffn(rows,
                          d.group_sizes,
                          params,
                          config,
                          backend=backend,
                          row_weights=dispatch_lib.row_weights(r.weights, d))
    y = ops.unpermute(out_rows, d.row_map, t, backend=backend)
    return MoEOutput(y=y,
                     aux_loss=aux,
                     z_loss=zl,
                     tokens_per_expert=counts,
                     dropped_tokens=d.dropped_tokens,
                     router_entropy=ent)


def moe_block(params: dict,
              x,
              config: MoEConfig,
              *,
              mesh=None,
              resources=None,
              paddings: Optional[jax.Array] = None) -> MoEOutput:
    """The MoE feed-forward block.

    params: see init_moe_params. x: [..., M]. paddings: optional x.shape[:-1], 1 = padded
    (padded tokens route nowhere, output zeros and count in no statistic).
    mesh / resources: run expert-parallel over `mesh` with the roles in `resources`
    (moe_praxis.MeshResources); both None = one device.
    Returns MoEOutput (y has x's shape and dtype).
    """
    check_params(params, config)
    x2, valid, seq_len = _flatten(x, paddings, config)
    backend = resolve_backend(config.kernel_backend, "moe_block")
    if mesh is not None or resources is not None:
        if mesh is None or resources is None:
            raise ValueError("moe_block needs both mesh and resources for expert parallelism "
                             f"(got mesh={mesh!r}, resources={resources!r})")
        from moe_praxis import ep

        out = ep.moe_sharded(params,
                             x2,
                             valid,
                             config,
                             mesh=mesh,
                             resources=resources,
                             seq_len=seq_len,
                             backend=backend)
    else:
        out = moe_local(params, x2, valid, config, seq_len=seq_len, backend=backend)
    return dataclasses.replace(out, y=out.y.reshape(x.shape).astype(x.dtype))
