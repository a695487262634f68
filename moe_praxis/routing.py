"""Router: logits -> scores -> top-k expert ids and weights (statistics: router_stats.py).

All routing math is float32. Letters: T tokens, M d_model, E experts, k top_k.

Selection and weights (config fields in MoEConfig):
  softmax, pre_softmax=True:  s = softmax(logits); ids = topk(s + bias); w = s[ids]
                              (then w /= sum(w) if norm_topk)
  softmax, pre_softmax=False: ids = topk(logits + bias); w = softmax(logits[ids])
  sigmoid:                    s = sigmoid(logits); ids = topk(s + bias); w = s[ids]
                              (then w /= sum(w) if norm_topk)
  w *= routed_scaling_factor.
The expert bias steers selection only; weights always come from unbiased scores.
Group-limited top-k masks all but the best `group_topk` of `num_expert_groups` groups before
the top-k; a group's score is the sum of its top `top_k // group_topk` selection scores.
Ties go to the lower expert index (jax.lax.top_k's order).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouteOutput:
    logits: jax.Array  # [T, E] float32, after the optional logit cap
    probs: jax.Array  # [T, E] float32 dense probabilities for the load-balancing loss
    expert_ids: jax.Array  # [T, k] int32
    weights: jax.Array  # [T, k] float32 combine weights


def router_logits(x, w_router, config: MoEConfig):
    """x: [T, M] -> float32 logits [T, E] (soft-capped when router_logit_cap > 0)."""
    logits = jnp.dot(x.astype(jnp.float32),
                     w_router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    if config.router_logit_cap > 0:
        cap = config.router_logit_cap
        logits = cap * jnp.tanh(logits / cap)
    return logits


def _group_limit(sel, config: MoEConfig):
    """Masks (to -inf) the experts outside each token's best `group_topk` groups."""
    t, e = sel.shape
    g = config.num_expert_groups
    per_group = sel.reshape(t, g, e // g)
    group_scores = jax.lax.top_k(per_group, config.top_k // config.group_topk)[0].sum(-1)
    _, keep = jax.lax.top_k(group_scores, config.group_topk)  # [T, group_topk]
    keep_mask = jnp.sum(jax.nn.one_hot(keep, g, dtype=jnp.int32), axis=1) > 0  # [T, G]
    keep_mask = jnp.repeat(keep_mask, e // g, axis=1)
    return jnp.where(keep_mask, sel, -jnp.inf)


def route_logits(logits,
                 config: MoEConfig,
                 expert_bias: Optional[jax.Array] = None,
                 *,
                 backend: str = "auto"):
    """logits: [T, E] float32 -> RouteOutput. See the module docstring for the math.

    backend: 'auto' | 'xla' | 'cuda' (moe_praxis.ops.resolve_backend); 'cuda' runs the fused
    router kernel (ops.cuda.fused_router, forward and backward), which computes the same as
    route_logits_reference.
    """
    if ops.resolve_backend(backend, "router") == "cuda":
        why = ops.cuda.router_unsupported(logits.shape[-1], config)
        if not why:
            logits = logits.astype(jnp.float32)
            bias = (jnp.zeros((logits.shape[-1], ), jnp.float32) if expert_bias is None else
                    jax.lax.stop_gradient(expert_bias.astype(jnp.float32)))
            probs, ids, weights = ops.cuda.fused_router(config, logits, bias)
            return RouteOutput(logits=logits, probs=probs, expert_ids=ids, weights=weights)
        ops.cuda.warn_fallback("router", why)
    return route_logits_reference(logits, config, expert_bias)


def route_logits_reference(logits, config: MoEConfig, expert_bias: Optional[jax.Array] = None):
    """Pure-JAX router: logits [T, E] float32 -> RouteOutput (the CPU path and test oracle)."""
    logits = logits.astype(jnp.float32)
    bias = None
    if expert_bias is not None:
        bias = jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    if config.score_func == "softmax":
        dense = jax.nn.softmax(logits, axis=-1)
        probs = dense
        sel_base = dense if config.pre_softmax else logits
    else:
        dense = jax.nn.sigmoid(logits)
        probs = dense / jnp.sum(dense, axis=-1, keepdims=True)
        sel_base = dense
    sel = sel_base if bias is None else sel_base + bias
    if config.num_expert_groups > 1:
        sel = _group_limit(sel, config)
    _, ids = jax.lax.top_k(sel, config.top_k)
    if config.score_func == "softmax" and not config.pre_softmax:
        weights = jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(dense, ids, axis=-1)
        if config.norm_topk and config.top_k == 1:
            weights = jnp.ones_like(weights)  # exactly 1, with exactly zero gradient
        elif config.norm_topk:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    return RouteOutput(logits=logits,
                       probs=probs,
                       expert_ids=ids.astype(jnp.int32),
                       weights=weights)


def route(x, w_router, config: MoEConfig, expert_bias: Optional[jax.Array] = None):
    """x: [T, M], w_router: [M, E] -> RouteOutput."""
    return route_logits(router_logits(x, w_router, config), config, expert_bias)
