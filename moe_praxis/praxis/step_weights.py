"""A model's expert weights cast to the layers' compute dtype once per step.

Praxis casts a float32 weight to the layer's fprop_dtype each time the layer reads it: in the
forward, and again where a rematerialized layer recomputes its forward inside the backward, so
a scanned, rematerialized stack reads every expert weight in float32 twice a step and writes
its bfloat16 copy twice. A train step that calls
`cast_expert_weights(params, dtype)` inside its loss, before the model's apply and outside the
scanned layers, makes that copy once; the layers then find their expert weights already in
`dtype`, and Praxis casts nothing. The values are the same (the same cast of the same weights)
and so are the gradients (each expert weight is read once per forward, so its cotangent is the
same bfloat16 array, converted to float32 once by the cast's transpose). The price: the
bfloat16 copy of every expert weight stays alive from the forward to the backward.

MoE layers' params are recognised by their keys (a 'router' and a 'wo' beside it, the
moe.param_shapes contract), stacked or not.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_praxis.expert_weights import GATHERED


def is_moe_params(node) -> bool:
    """Whether a params node is an MoE layer's (a 'router' and expert weights 'wo' [E, H, M],
    with a leading layer dimension where the layers are stacked)."""
    return isinstance(node, dict) and "router" in node and "wo" in node and node["wo"].ndim >= 3


def cast_expert_weights(params, dtype) -> dict:
    """``params`` (nested dicts) with every MoE layer's routed expert weights (wi_gate, wi_up or
    the fused wi_gate_up, wo: expert_weights.GATHERED) cast to ``dtype``; the other entries
    (the router, the expert bias, shared experts, every other layer) as they are. Differentiable: the gradient w.r.t. the float32
    weights is the cast's transpose."""
    dtype = jnp.dtype(dtype)
    out = {}
    for key, node in params.items():
        if is_moe_params(node):
            out[key] = {
                k: v.astype(dtype) if k in GATHERED and jnp.issubdtype(v.dtype, jnp.floating) else v
                for k, v in node.items()
            }
        elif isinstance(node, dict):
            out[key] = cast_expert_weights(node, dtype)
        else:
            out[key] = node
    return out
