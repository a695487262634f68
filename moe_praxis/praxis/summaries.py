"""The Praxis layer's scalar summaries (docs/praxis.md's table), from the block's own
statistics (MoEOutput): no second router matmul, and under expert parallelism the global
batch's values (the block reduces them over every token axis).

No praxis import: the layer adds each with add_summary.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from moe_praxis.config import MoEConfig
from moe_praxis.moe import MoEOutput
from moe_praxis.ops.fp8 import rule as fp8_rule


def moe_summaries(out: MoEOutput, paddings: Optional[jax.Array], num_tokens: int,
                  config: MoEConfig) -> dict[str, jax.Array]:
    """{name: scalar}: moe_aux_loss, moe_z_loss, moe_router_entropy, moe_routed_copies = valid
    tokens * k (the load's denominator: load * copies gives back the integer counts),
    moe_dropped_token_fraction = dropped copies / (valid tokens * k), moe_expert_load_{e} =
    copies the router sent to expert e / (valid tokens * k), before drops, and with config.fp8
    moe_fp8_{fwd,dgrad,wgrad} (the share of the expert weights whose GEMM of that kind ran in
    FP8 in this call, out.fp8_gemms: 0 where 'auto' ran the bf16 layer).

    paddings: the layer's paddings (1 = padded) or None (all num_tokens tokens valid)."""
    n_valid = (jnp.float32(num_tokens) if paddings is None else jnp.sum(
        (paddings < 0.5).astype(jnp.float32)))
    copies = jnp.maximum(n_valid, 1.0) * config.top_k
    out_summaries = {
        "moe_aux_loss": out.aux_loss,
        "moe_z_loss": out.z_loss,
        "moe_router_entropy": out.router_entropy,
        "moe_routed_copies": copies,
        "moe_dropped_token_fraction": out.dropped_tokens.astype(jnp.float32) / copies,
    }
    load = out.tokens_per_expert.astype(jnp.float32) / copies
    for e in range(load.shape[0]):
        out_summaries[f"moe_expert_load_{e}"] = load[e]
    for gemm, share in fp8_rule.shares(dict(out.fp8_gemms)).items():
        out_summaries[f"moe_fp8_{gemm}"] = jnp.float32(share)
    return out_summaries
