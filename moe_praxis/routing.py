"""Router: logits -> scores -> top-k expert ids and weights, plus the router losses.

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
from moe_praxis.ops import router as router_op


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


def tokens_per_expert(expert_ids, num_experts: int, valid=None):
    """[T, k] ids -> [E] int32 counts of routed copies (rows with valid=False count nothing)."""
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.int32)  # [T, k, E]
    if valid is not None:
        one_hot = one_hot * valid[:, None, None].astype(jnp.int32)
    return jnp.sum(one_hot, axis=(0, 1))


# ----------------------------------------------------------------------------- losses


def load_balance_loss(route_out: RouteOutput,
                      config: MoEConfig,
                      valid,
                      *,
                      seq_len=None,
                      counts=None,
                      num_tokens=None,
                      backend: str = "auto"):
    """The configured load-balancing loss (coefficient applied), float32 scalar.

    valid: [T] bool, False for padded tokens (they count in no statistic).
    'switch':   ops.aux_loss over all valid tokens (see moe_praxis.ops.aux_loss).
    'sequence': the same per sequence of `seq_len` consecutive tokens, averaged over sequences.
    'gshard':   Praxis GShard's top-1 density loss, coeff * E / T^2 * sum_e P[e] * f1[e], with
                P[e] = sum_t p[t, e] and f1[e] the number of tokens whose FIRST choice is e.
    `counts`/`num_tokens` override the local statistics (the EP path passes global ones).
    backend: the kernel backend of ops.aux_loss ('auto' | 'xla' | 'cuda').
    """
    e, k = config.num_experts, config.top_k
    vf = valid.astype(jnp.float32)
    probs = route_out.probs * vf[:, None]
    if config.aux_loss_type == "sequence":
        if seq_len is None:
            raise ValueError("aux_loss_type='sequence' needs x of shape [..., S, d_model]")
        b = probs.shape[0] // seq_len
        p = probs.reshape(b, seq_len, e)
        ids = route_out.expert_ids.reshape(b, seq_len, k)
        v = valid.reshape(b, seq_len)
        f = jax.vmap(lambda i, m: tokens_per_expert(i, e, m))(ids, v)  # [B, E]
        n = jnp.maximum(jnp.sum(v, axis=1), 1)
        per_seq = jax.vmap(lambda pp, ff, nn: ops.aux_loss(
            pp, ff, top_k=k, coeff=config.aux_loss_coeff, num_tokens=nn, backend=backend))(p, f, n)
        return jnp.mean(per_seq)
    if num_tokens is None:
        num_tokens = jnp.maximum(jnp.sum(valid.astype(jnp.int32)), 1)
    if config.aux_loss_type == "gshard":
        f1 = tokens_per_expert(route_out.expert_ids[:, :1], e, valid) if counts is None else counts
        return ops.aux_loss(probs,
                            f1,
                            top_k=1,
                            coeff=config.aux_loss_coeff,
                            num_tokens=num_tokens,
                            backend=backend)
    f = tokens_per_expert(route_out.expert_ids, e, valid) if counts is None else counts
    return ops.aux_loss(probs,
                        f,
                        top_k=k,
                        coeff=config.aux_loss_coeff,
                        num_tokens=num_tokens,
                        backend=backend)


def z_loss(logits, valid, coeff: float, num_tokens=None):
    """Router z-loss: coeff * mean over valid tokens of logsumexp(logits)^2 (float32 scalar)."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    vf = valid.astype(jnp.float32)
    if num_tokens is None:
        num_tokens = jnp.maximum(jnp.sum(vf), 1.0)
    return coeff * jnp.sum(lse * lse * vf) / num_tokens


def router_entropy(logits, valid, num_tokens=None):
    """Mean over valid tokens of the entropy of softmax(logits), in nats (float32 scalar, no
    gradient): a diagnostic of how decided the router is, whatever its score function."""
    logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    vf = valid.astype(jnp.float32)
    if num_tokens is None:
        num_tokens = jnp.maximum(jnp.sum(vf), 1.0)
    return jnp.sum(ent * vf) / num_tokens
