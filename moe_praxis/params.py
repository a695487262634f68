"""The MoE block's parameter tree: its shapes, a random initialisation and the shape check.

Letters: M d_model, H d_ff, E experts.

  router      [M, E]     the router's logits projection
  wi_gate     [E, M, H]  gate projection (gated experts, unfused)
  wi_up       [E, M, H]  up projection (unfused)
  wi_gate_up  [E, M, 2H] gate and up columns interleaved (fuse_gate_up; ops.gate_up)
  wo          [E, H, M]  down projection
  expert_bias [E]        selection-only bias (use_expert_bias)
  shared_wi_gate [M, Hs] the shared experts' gate projection (num_shared_experts, gated)
  shared_wi_up   [M, Hs] the shared experts' up projection (num_shared_experts)
  shared_wo      [Hs, M] the shared experts' down projection (num_shared_experts)
  shared_gate    [M, 1]  the shared output's sigmoid gate (shared_expert_gate)

Hs = config.shared_hidden (shared_d_ff, or num_shared_experts * d_ff).

`param_shapes` is the contract between init, the Praxis layer, converters and the sharding
(`EPLayout.weight_specs` names the same keys).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_praxis.config import MoEConfig


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
    hs = config.shared_hidden
    if hs:
        shapes["shared_wi_up"] = (m, hs)
        shapes["shared_wo"] = (hs, m)
        if config.gated:
            shapes["shared_wi_gate"] = (m, hs)
        if config.shared_expert_gate:
            shapes["shared_gate"] = (m, 1)
    return shapes


def init_moe_params(key, config: MoEConfig, dtype=jnp.float32) -> dict:
    """Random parameters: normal(0, scale / sqrt(fan_in)); expert_bias zeros.

    Keys: router [M, E], wi_gate [E, M, H] (gated only), wi_up [E, M, H], wo [E, H, M],
    expert_bias [E] (use_expert_bias only); with fuse_gate_up, wi_gate_up [E, M, 2H] instead of
    wi_gate and wi_up (each interleaved half drawn as they are: fan_in M). With shared experts,
    shared_wi_gate [M, Hs] (gated only), shared_wi_up [M, Hs], shared_wo [Hs, M] and with
    shared_expert_gate shared_gate [M, 1], drawn the same way (fan_in: the second-to-last dim).
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


# Parameters that gradients do not train: the expert bias is moved by update_expert_bias only.
NON_TRAINABLE = frozenset({"expert_bias"})


def trainable_mask(params: dict) -> dict:
    """``{name: bool}`` over ``params``: False for what gradients must not train
    (``expert_bias``, moved once per step by ``moe_praxis.update_expert_bias``), True for the
    weights. For optax: ``optax.multi_transform({True: optax.adamw(lr), False:
    optax.set_to_zero()}, moe_praxis.trainable_mask(params))`` leaves ``expert_bias`` to the
    bias update (no Adam step, no weight decay)."""
    return {name: name not in NON_TRAINABLE for name in params}


def check_params(params: dict, config: MoEConfig) -> None:
    """Raises ValueError naming any missing, unexpected or mis-shaped parameter."""
    want = param_shapes(config)
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(
            f"MoE params do not match the config: missing {missing}, unexpected {extra} "
            f"(gated={config.gated}, fuse_gate_up={config.fuse_gate_up}, "
            f"use_expert_bias={config.use_expert_bias}, "
            f"num_shared_experts={config.num_shared_experts}, "
            f"shared_expert_gate={config.shared_expert_gate})")
    for name, shape in want.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"MoE param {name!r} has shape {tuple(params[name].shape)}; "
                             f"the config needs {shape}")
