"""Auxiliary-loss-free load balancing (DeepSeek-V3): the expert bias rule, applied once per
optimizer step outside the gradient.

Letters: E experts. The bias `expert_bias` [E] is added to the router's selection scores only
(MoEConfig.use_expert_bias; the routing weights come from the unbiased scores), so it has no
gradient; this rule moves it instead, from the step's global token counts (MoEOutput's
tokens_per_expert, already summed over every token axis):

    b_e <- b_e + u * sign(mean_load - load_e),   mean_load = sum_e load_e / E,   sign(0) = 0

An overloaded expert's bias falls and an underloaded one's rises by the same step u
(MoEConfig.expert_bias_update_rate), whatever the size of the imbalance.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp


def update_expert_bias(expert_bias, tokens_per_expert, rate):
    """One step of DeepSeek-V3's bias update: the new expert_bias [E] float32.

    expert_bias: [E] (any float dtype); tokens_per_expert: [E] the step's global load (int32
    counts from moe_block, or floats); rate: u >= 0, a Python number or a scalar array (e.g.
    MoEConfig.expert_bias_update_rate). Computes, in float32,
    `expert_bias + rate * sign(sum(load) / E - load)` with sign(0) = 0: an expert at exactly
    the mean load keeps its bias, and an all-zero load (nothing routed) changes nothing.
    Raises ValueError naming a bad shape or a negative / non-finite Python rate.
    """
    b = jnp.asarray(expert_bias, jnp.float32)
    load = jnp.asarray(tokens_per_expert, jnp.float32)
    if b.ndim != 1 or load.shape != b.shape:
        raise ValueError(f"update_expert_bias needs expert_bias [E] and tokens_per_expert [E] of "
                         f"one length, got shapes {b.shape} and {load.shape}")
    if isinstance(rate, numbers.Real) and not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"update_expert_bias: rate={rate!r} is invalid: must be a finite "
                         "number >= 0 (MoEConfig.expert_bias_update_rate)")
    rate = jnp.asarray(rate, jnp.float32)
    if rate.ndim:
        raise ValueError(f"update_expert_bias: rate must be a scalar, got shape {rate.shape}")
    mean_load = jnp.sum(load) / load.shape[0]
    return b + rate * jnp.sign(mean_load - load)
