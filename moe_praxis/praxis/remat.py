"""Remat policies of the transformer stack beyond Praxis's own: what the backward recomputes.

Praxis rematerializes a stack through ``nn.remat(policy=checkpoint_policy.custom_policy(p))``
with ``p`` the stack's ``checkpoint_policy`` field (``StackedTransformerRepeated``'s around
each scanned layer, ``StackedTransformer``'s around each layer when ``remat``), and
``custom_policy`` knows only Praxis's AutodiffCheckpointType. Importing this module extends it:
a ``checkpoint_policy`` that names one of POLICIES resolves to that ``jax.checkpoint`` policy,
every other value as before. ``configs.models.set_remat`` writes the names into a model config
(and 'full' / 'none', which are Praxis's own settings).

The named values are the ``checkpoint_name``s the layers write:
  query_proj, key_proj, value_proj, context, out_proj   GroupedQueryAttention
  moe_router_logits, moe_dispatched, moe_gate, moe_up, ffn1, ffn2   the MoE block
  moe_out                                                MoEFeedForward's output (pre-residual)
The fused expert ops (gate/up with SwiGLU, with the down projection too, and their FP8 form)
name their gate and up residuals inside their custom_vjp forward rules, so a policy that saves
moe_gate and moe_up reruns none of them.
"""

from __future__ import annotations

import jax
from praxis.layers import checkpoint_policy

_ATTENTION = ("query_proj", "key_proj", "value_proj", "context", "out_proj")
_MOE_GEMMS = ("moe_router_logits", "moe_dispatched", "moe_gate", "moe_up", "ffn1", "ffn2")
_names = jax.checkpoint_policies.save_only_these_names

# name -> (what the backward keeps instead of recomputing, the jax.checkpoint policy)
POLICIES = {
    "save_dots": ("every XLA dot's output (custom calls, e.g. the CUDA expert GEMMs, and "
                  "cuDNN's attention are recomputed)", jax.checkpoint_policies.checkpoint_dots),
    "save_dot_except_mlp": ("the attention's projections, context and output; the MoE layer "
                            "is recomputed", _names(*_ATTENTION)),
    "save_moe_and_attention_out":
    ("the attention's and the MoE layer's outputs (out_proj, "
     "moe_out); their insides are recomputed", _names("out_proj", "moe_out")),
    "save_attention_and_moe_gemms":
    ("every named output of the attention and the MoE block "
     "(its GEMMs, dispatched rows and router logits): only "
     "elementwise work is recomputed", _names(*_ATTENTION, *_MOE_GEMMS, "moe_out")),
}

_praxis_custom_policy = checkpoint_policy.custom_policy


def custom_policy(policy):
    """Praxis's ``custom_policy``, which also resolves the names of POLICIES."""
    if isinstance(policy, str) and type(policy) is str and policy in POLICIES:
        return POLICIES[policy][1]
    return _praxis_custom_policy(policy)


custom_policy._moe_praxis_remat = True
if not getattr(checkpoint_policy.custom_policy, "_moe_praxis_remat", False):
    checkpoint_policy.custom_policy = custom_policy
