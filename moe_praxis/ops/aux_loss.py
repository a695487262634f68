"""The switch load-balancing loss as a custom_vjp primitive.

    L = coeff * E / (k * T^2) * sum_e (sum_t p[t, e]) * f[e]

p: [T_rows, E] dense routing probabilities; f: [E] number of token copies routed to each
expert; T the number of tokens (by default the rows of p; pass `num_tokens` when rows are
padding, or when p is one shard of a global batch whose f and T are global: the shards'
losses then add up to the global loss); k = top_k. Balanced routing gives L = coeff.

    dL/dp[t, e] = g * coeff * E / (k * T^2) * f[e]

The cotangent g of the scalar loss is rank 0 and stays rank 0 (never reshaped to [1]: a
rank-1 cotangent breaks Shardy lowering of a sharded primitive whose rule declares it
rank 0). f and T are counts and get no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import cuda
from moe_praxis.ops.backend import resolve_backend


def aux_loss_scale(num_tokens, num_experts: int, top_k: int, coeff: float):
    """coeff * E / (k * T^2) as a float32 scalar (T may be traced)."""
    t = jnp.asarray(num_tokens, jnp.float32)
    return coeff * num_experts / (top_k * t * t)


def aux_loss_reference(probs, tokens_per_expert, *, top_k: int, coeff: float, num_tokens=None):
    """Pure-JAX forward: float32 scalar. probs: [T, E]; tokens_per_expert: [E]."""
    t = probs.shape[0] if num_tokens is None else num_tokens
    p = probs.astype(jnp.float32)
    f = tokens_per_expert.astype(jnp.float32)
    return aux_loss_scale(t, probs.shape[1], top_k, coeff) * jnp.sum(jnp.sum(p, axis=0) * f)


def aux_loss_bwd_reference(g,
                           probs,
                           tokens_per_expert,
                           *,
                           top_k: int,
                           coeff: float,
                           num_tokens=None):
    """dL/dp: [T, E] in probs.dtype; g is the rank-0 cotangent."""
    if jnp.ndim(g) != 0:
        raise ValueError(f"aux-loss cotangent must be rank 0, got shape {jnp.shape(g)}")
    t = probs.shape[0] if num_tokens is None else num_tokens
    f = tokens_per_expert.astype(jnp.float32)
    row = g.astype(jnp.float32) * aux_loss_scale(t, probs.shape[1], top_k, coeff) * f
    # ones_like keeps probs' sharding (a plain broadcast would be replicated, which an
    # Explicit-sharding mesh rejects as the cotangent of a sharded input).
    return (row[None, :] * jnp.ones_like(probs, dtype=jnp.float32)).astype(probs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _aux_loss(probs, tokens_per_expert, num_tokens, top_k, coeff):
    return aux_loss_reference(probs,
                              tokens_per_expert,
                              top_k=top_k,
                              coeff=coeff,
                              num_tokens=num_tokens)


def _fwd(probs, tokens_per_expert, num_tokens, top_k, coeff):
    out = _aux_loss(probs, tokens_per_expert, num_tokens, top_k, coeff)
    return out, (probs, tokens_per_expert, num_tokens)


def _bwd(top_k, coeff, res, g):
    probs, tpe, t = res
    dp = aux_loss_bwd_reference(g, probs, tpe, top_k=top_k, coeff=coeff, num_tokens=t)
    return dp, cuda.zero_cotangent(tpe), cuda.zero_cotangent(t)


_aux_loss.defvjp(_fwd, _bwd)


def aux_loss(probs,
             tokens_per_expert,
             *,
             top_k: int,
             coeff: float,
             num_tokens=None,
             backend: str = "auto"):
    """Switch load-balancing loss (float32 scalar, coefficient applied). See the module doc.

    probs: [T, E] float; tokens_per_expert: [E] (int or float); num_tokens: optional rank-0
    count T (default: T = rows of probs). Gradient flows to probs only.
    backend: 'auto' | 'xla' | 'cuda'; 'cuda' runs the fused kernels (ops.cuda.aux_loss, whose
    sharding rule keeps the cotangent rank 0 and sums the shards' losses).
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [T, E], got shape {probs.shape}")
    if tokens_per_expert.shape != (probs.shape[1], ):
        raise ValueError(
            f"tokens_per_expert must be [E={probs.shape[1]}], got {tokens_per_expert.shape}")
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if num_tokens is None:
        num_tokens = probs.shape[0]
    num_tokens = jnp.asarray(num_tokens)
    if num_tokens.ndim != 0:
        raise ValueError(f"num_tokens must be a scalar, got shape {num_tokens.shape}")
    if resolve_backend(backend, "aux_loss") == "cuda":
        if probs.dtype in (jnp.float32, jnp.bfloat16):
            return cuda.aux_loss(probs, tokens_per_expert, num_tokens, int(top_k), float(coeff))
        cuda.warn_fallback("aux_loss", f"probs dtype {probs.dtype} (float32 / bfloat16 only)")
    return _aux_loss(probs, tokens_per_expert, num_tokens, int(top_k), float(coeff))
