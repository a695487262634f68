"""Router statistics: tokens per expert, the load-balancing loss, the z-loss and the router
entropy, each reduced over every token axis so that it equals the single-device value on the
global batch.

Letters: T tokens (of this token shard), E experts, k top_k, S seq_len, B sequences.
All statistics are float32 (counts int32); padded tokens (valid False) count in none.

Under expert parallelism each shard adds its share computed with the GLOBAL counts and
valid-token count, and the shares are psum-ed over the token axes; with no token axes (one
device) every psum is the identity and the formulas are the plain single-device ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.resources import psum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    tokens_per_expert: jax.Array  # [E] int32 token copies the router assigned (before drops)
    aux_loss: jax.Array  # [] float32 load-balancing loss, coefficient applied
    z_loss: jax.Array  # [] float32 router z-loss, coefficient applied
    router_entropy: jax.Array  # [] float32 mean entropy of softmax(logits), no gradient


def tokens_per_expert(expert_ids, num_experts: int, valid=None):
    """[T, k] ids -> [E] int32 counts of routed copies (rows with valid=False count nothing)."""
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.int32)  # [T, k, E]
    if valid is not None:
        one_hot = one_hot * valid[:, None, None].astype(jnp.int32)
    return jnp.sum(one_hot, axis=(0, 1))


def load_balance_loss(route_out,
                      config: MoEConfig,
                      valid,
                      *,
                      seq_len=None,
                      counts=None,
                      num_tokens=None,
                      backend: str = "auto"):
    """The configured load-balancing loss (coefficient applied), float32 scalar.

    route_out: routing.RouteOutput (probs [T, E] and expert_ids [T, k] are read).

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


def router_statistics(route_out,
                      logits,
                      valid,
                      config: MoEConfig,
                      *,
                      token_axes: tuple = (),
                      seq_len=None,
                      t_global: int,
                      backend: str) -> RouterStats:
    """The block's router statistics over the GLOBAL batch, from one token shard.

    route_out: routing.RouteOutput of the shard's tokens; logits: [T, E] float32; valid: [T]
    bool; token_axes: the mesh axes tokens are split over (() = one device); t_global: tokens
    of the global batch; backend: the resolved kernel backend of ops.aux_loss.
    'sequence' needs whole sequences per shard (each shard's mean over its T / S sequences,
    weighted by its share of the B = t_global / S sequences).
    """
    e = config.num_experts
    t_l = logits.shape[0]
    counts = psum(tokens_per_expert(route_out.expert_ids, e, valid), token_axes)
    n_valid = psum(jnp.sum(valid.astype(jnp.int32)), token_axes)
    num_tokens = jnp.maximum(n_valid, 1)
    if config.aux_loss_type == "sequence":
        aux = load_balance_loss(route_out, config, valid, seq_len=seq_len, backend=backend)
        if token_axes:
            aux = psum(aux * (t_l // seq_len), token_axes) / (t_global // seq_len)
    else:
        if config.aux_loss_type == "gshard":
            f = psum(tokens_per_expert(route_out.expert_ids[:, :1], e, valid), token_axes)
        else:
            f = counts
        aux = psum(
            load_balance_loss(route_out,
                              config,
                              valid,
                              counts=f,
                              num_tokens=num_tokens,
                              backend=backend), token_axes)
    n_f = num_tokens.astype(jnp.float32)
    zl = psum(z_loss(logits, valid, config.z_loss_coeff, num_tokens=n_f), token_axes)
    ent = psum(router_entropy(logits, valid, num_tokens=n_f), token_axes)
    return RouterStats(tokens_per_expert=counts, aux_loss=aux, z_loss=zl, router_entropy=ent)
