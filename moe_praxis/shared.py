"""Shared experts: one dense FFN that every non-padded token goes through besides its routed
experts (DeepSeek-V2/V3, Qwen2-MoE), added to the routed output inside the block.

Letters: Tl tokens of one device, M d_model, Hs = config.shared_hidden (Hs / tp on one device).

  gated:    act(x @ shared_wi_gate) * (x @ shared_wi_up) @ shared_wo
  ungated:  act(x @ shared_wi_up) @ shared_wo
  with shared_expert_gate, the output times sigmoid(x @ shared_gate) per token (Qwen2-MoE).

Sharded like a dense FFN (EPLayout.weight_specs): tp on Hs (each tp shard returns a partial sum,
which the block's psum over tp adds up with the routed output's), fsdp on d_model (all-gathered
here, so the gradients come back reduce-scattered), replicated over dp and ep: each EP rank
computes the shared branch of its own tokens, with no exchange.

Checkpoint names: 'moe_shared_ffn1' [Tl, Hs] (the activation), 'moe_shared_ffn2' [Tl, M].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.ops import vma
from moe_praxis.resources import EPLayout

# parameter -> the dimension fsdp shards (d_model); shared_gate is replicated.
_FSDP_DIM = {"shared_wi_gate": 0, "shared_wi_up": 0, "shared_wo": 1}


def gather_shared_weights(params, layout: EPLayout) -> dict:
    """This device's shared-expert weights, all-gathered over fsdp: shared_wi_gate /
    shared_wi_up [M, Hs/tp], shared_wo [Hs/tp, M], shared_gate [M, 1], each marked varying over
    the token and tp axes like the rows they multiply. {} without shared experts."""
    out = {}
    for name in (*_FSDP_DIM, "shared_gate"):
        if name not in params:
            continue
        w = params[name]
        if layout.fsdp_axes and name in _FSDP_DIM:
            w = jax.lax.all_gather(w, layout.fsdp_axes, axis=_FSDP_DIM[name], tiled=True)
        out[name] = vma.vary(w, layout.token_axes + (layout.tp_axes if name in _FSDP_DIM else ()))
    return out


def shared_ffn(x, valid, weights, config: MoEConfig, *, backend: str):
    """x: [Tl, M]; valid: [Tl] bool; weights: gather_shared_weights' output -> [Tl, M] float32,
    this tp shard's partial sum of the shared output (exactly zero on padded tokens).

    The projections run in x.dtype, the activation in float32 (ops.swiglu, as the routed
    experts do), the down projection accumulates in float32.
    """
    dt = x.dtype
    xs = vma.vary(x, tuple(vma.varying_axes(weights["shared_wo"])))
    up = jnp.dot(xs, weights["shared_wi_up"].astype(dt))
    if config.gated:
        gate = jnp.dot(xs, weights["shared_wi_gate"].astype(dt))
        act = ops.swiglu(gate, up, None, act=config.activation, backend=backend)
    else:
        act = ops.activation(config.activation)(up.astype(jnp.float32)).astype(dt)
    act = checkpoint_name(act, "moe_shared_ffn1")
    out = jnp.dot(act, weights["shared_wo"].astype(dt), preferred_element_type=jnp.float32)
    out = checkpoint_name(out, "moe_shared_ffn2")
    if config.shared_expert_gate:
        logit = jnp.dot(x, weights["shared_gate"].astype(dt), preferred_element_type=jnp.float32)
        out = out * vma.vary(jax.nn.sigmoid(logit), tuple(vma.varying_axes(out)))
    return jnp.where(vma.vary(valid, tuple(vma.varying_axes(out)))[:, None], out, 0.0)
