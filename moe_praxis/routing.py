"""Router: logits -> scores -> top-k expert ids and weights (statistics: router_stats.py).

All routing math after the logits is float32 (the logits GEMM: MoEConfig.router_precision). Letters: T tokens, M d_model, E experts, k top_k.

The math of selection and weights is written once, in moe_praxis.ops.router (the op's
docstring); `router_args` maps MoEConfig's fields to the op's static arguments (score_func,
pre_softmax, norm_topk, num_expert_groups -> num_groups, group_topk, routed_scaling_factor ->
scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from moe_praxis.config import MoEConfig
from moe_praxis.ops import router as router_op


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouteOutput:
    logits: jax.Array  # [T, E] float32, after the optional logit cap
    probs: jax.Array  # [T, E] float32 dense probabilities for the load-balancing loss
    expert_ids: jax.Array  # [T, k] int32
    weights: jax.Array  # [T, k] float32 combine weights


def router_logits(x, w_router, config: MoEConfig):
    """x: [T, M] -> float32 logits [T, E] (soft-capped when router_logit_cap > 0); the GEMM in
    config.router_precision (ops.router.router_gemm), on every kernel backend."""
    logits = router_op.router_gemm(x, w_router, precision=config.router_precision)
    if config.router_logit_cap > 0:
        cap = config.router_logit_cap
        logits = cap * jnp.tanh(logits / cap)
    return logits


def router_args(config: MoEConfig) -> dict:
    """The router op's static arguments (moe_praxis.ops.router.RouterArgs) from a config."""
    return dict(score_func=config.score_func,
                pre_softmax=config.pre_softmax,
                top_k=config.top_k,
                norm_topk=config.norm_topk,
                num_groups=config.num_expert_groups,
                group_topk=config.group_topk,
                scaling=config.routed_scaling_factor)


def route_logits(logits,
                 config: MoEConfig,
                 expert_bias: Optional[jax.Array] = None,
                 *,
                 backend: str = "auto"):
    """logits: [T, E] float32 -> RouteOutput. See the module docstring for the math.

    backend: 'auto' | 'xla' | 'cuda' (moe_praxis.ops.resolve_backend); 'cuda' runs the fused
    router kernel (ops.router, forward and backward), which computes the same as
    route_logits_reference.
    """
    logits = logits.astype(jnp.float32)
    probs, ids, weights = router_op.route(logits,
                                          expert_bias,
                                          backend=backend,
                                          **router_args(config))
    return RouteOutput(logits=logits, probs=probs, expert_ids=ids, weights=weights)


def route_logits_reference(logits, config: MoEConfig, expert_bias: Optional[jax.Array] = None):
    """Pure-JAX router: logits [T, E] float32 -> RouteOutput (the CPU path and test oracle)."""
    logits = logits.astype(jnp.float32)
    probs, ids, weights = router_op.router_reference(logits, expert_bias, **router_args(config))
    return RouteOutput(logits=logits, probs=probs, expert_ids=ids, weights=weights)


def route(x, w_router, config: MoEConfig, expert_bias: Optional[jax.Array] = None):
    """x: [T, M], w_router: [M, E] -> RouteOutput."""
    return route_logits(router_logits(x, w_router, config), config, expert_bias)
