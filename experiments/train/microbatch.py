"""Gradient accumulation: one optimizer step's batch run as n micro-batches
(``train.grad_accum_steps``), with what the step computes over the whole batch.

Letters: B the step's batch (rows), n micro-batches, D data shards (the devices of the token
axes), E experts, R stacked (scanned) layers.

- ``split``: ``[B, ...] -> [n, B/n, ...]``; each data shard's B/D rows are cut into n
  contiguous pieces and micro-batch m is every shard's piece m, so a micro-batch is spread
  over the devices as the batch is and no row moves between devices.
- ``accumulate``: ``jax.lax.scan`` over the micro-batches, summing float32 gradients and the
  micro-batches' sums; the caller's objective is built so that these sums are the whole
  step's (``experiments.train.steps``: the cross-entropy summed with the step's total weight).
- The expert bias (DeepSeek-V3's auxiliary-loss-free balancing) moves once per step, from
  the token counts of the whole step: ``expert_counts`` reads each micro-batch's counts back
  from the MoE layers' ``moe_expert_load_{e}`` and ``moe_routed_copies`` summaries (count =
  load x copies, rounded: the layer's own valid tokens x k, so padded tokens count nowhere;
  exact while a micro-batch sends fewer than 2^22 copies to one expert), ``update_biases`` applies ``moe_praxis.update_expert_bias`` to their sum:
  the same float32 inputs, so the same bias as one step on the whole batch. ``optax.MultiSteps``
  does not fit: it would step the schedule per micro-batch and keep extra optimizer state.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

import moe_praxis

from configs import models

_LOAD = "moe_expert_load_{}_scalar"  # MoEFeedForward's summary of expert e's load
_COPIES = "moe_routed_copies_scalar"  # its denominator: the layer's valid tokens x k
_BIAS = "expert_bias"


def check(batch_size: int, n: int, shards: int) -> Optional[str]:
    """Why ``n`` micro-batches cannot split a batch of ``batch_size`` rows over ``shards``
    data shards (None when they can)."""
    if batch_size % (shards * n) == 0:
        return None
    return (f"--fdl.train.grad_accum_steps={n} must divide the rows of each data shard: "
            f"data.batch_size={batch_size} over the {shards} devices of the token axes is "
            f"{batch_size / shards:g} per device (use a batch_size divisible by {shards * n})")


def bias_rule(model_config) -> Optional[float]:
    """The expert_bias_update_rate of the MoE layers that move their expert bias; None when
    none does. Raises ValueError when they do not share one rate (the step applies one rule to
    every layer's bias)."""
    rates = {
        float(c.expert_bias_update_rate)
        for c in models.moe_layer_configs(model_config) if c.use_expert_bias
    }
    if not rates or all(rate == 0 for rate in rates):
        return None
    if len(rates) > 1:
        raise ValueError(f"train.grad_accum_steps > 1 needs one expert_bias_update_rate over the "
                         f"MoE layers with use_expert_bias; got {sorted(rates)}")
    return rates.pop()


def split(batch: dict, n: int, shards: int) -> dict:
    """{name: [B, ...]} -> {name: [n, B/n, ...]} (module docstring); B divisible by D*n."""

    def one(x):
        b = x.shape[0]
        x = x.reshape((shards, n, b // (shards * n)) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape((n, b // n) + x.shape[3:])

    return {k: one(v) for k, v in batch.items()}


def accumulate(fn, params, micro: dict, key, grad_sharding=None):
    """Runs ``fn(params, micro_m, key_m) -> ((value, (sums, per_micro)), grads)`` (a
    ``jax.value_and_grad(..., has_aux=True)``) on each micro-batch m of ``micro`` ([n, ...]
    leaves) in a ``lax.scan``, key_m = fold_in(key, m).

    Returns (grads summed in float32 and cast to each parameter's dtype, the values' sum, the
    ``sums`` trees summed, the ``per_micro`` trees stacked [n, ...])."""
    n = jax.tree.leaves(micro)[0].shape[0]
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if grad_sharding is not None:
        zeros = jax.lax.with_sharding_constraint(zeros, grad_sharding)
    m0 = jax.tree.map(lambda x: x[0], micro)
    (_, (sums0, _)), _ = jax.eval_shape(fn, params, m0, key)
    init = (zeros, jnp.zeros(
        (), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums0))

    def body(carry, xs):
        grads, total, sums = carry
        batch, m = xs
        (value, (s, per_micro)), g = fn(params, batch, jax.random.fold_in(key, m))
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        sums = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), sums, s)
        return (grads, total + value.astype(jnp.float32), sums), per_micro

    (grads, total, sums), stacked = jax.lax.scan(body, init, (micro, jnp.arange(n)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, total, sums, stacked


def expert_counts(non_trainable: dict, summaries) -> dict:
    """The token copies each expert received in one forward pass, from its layer's
    ``moe_expert_load_{e}`` and ``moe_routed_copies`` summaries (load x copies, rounded): a
    tree mirroring ``non_trainable`` (a NON_TRAINABLE collection) with an [..., E] float32
    count in place of each expert bias."""
    out = {}
    for k, v in non_trainable.items():
        if k == _BIAS:
            num_e = v.shape[-1]
            missing = [
                name for name in [_COPIES] + [_LOAD.format(e) for e in range(num_e)]
                if name not in summaries
            ]
            if missing:
                raise ValueError(f"an expert_bias [{num_e}] without its layer's load summaries "
                                 f"({missing[0]} ...): grad_accum_steps needs them")
            loads = jnp.stack([
                jnp.asarray(summaries[_LOAD.format(e)], jnp.float32).reshape(-1)
                for e in range(num_e)
            ], -1)
            copies = jnp.asarray(summaries[_COPIES], jnp.float32).reshape(v.shape[:-1] + (1, ))
            out[k] = jnp.round(loads.reshape(v.shape) * copies)
        elif hasattr(v, "items"):
            sub = expert_counts(v, summaries.get(k, {}))
            if sub:
                out[k] = sub
    return out


def update_biases(non_trainable: dict, counts: dict, rate: float) -> dict:
    """``non_trainable`` with each expert bias b moved by ``moe_praxis.update_expert_bias(b,
    counts, rate)`` (stacked layers' [R, E] biases row by row)."""
    out = dict(non_trainable)
    for k, c in counts.items():
        if k == _BIAS:
            rule = lambda b, n: moe_praxis.update_expert_bias(b, n, rate)
            for _ in range(c.ndim - 1):
                rule = jax.vmap(rule)
            out[k] = rule(non_trainable[k], c).astype(non_trainable[k].dtype)
        else:
            out[k] = update_biases(non_trainable[k], c, rate)
    return out
