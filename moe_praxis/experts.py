"""Experts: grouped GEMMs gate/up -> activation -> down over expert-sorted rows.

Letters: R rows, M d_model, H d_ff, E experts (local experts under expert parallelism).
A gated expert computes act(x @ wi_gate) * (x @ wi_up) @ wo (SwiGLU with silu); a plain one
act(x @ wi_up) @ wo. Group sizes stay on the device.

Checkpoint names (for jax.checkpoint policies such as save_only_these_names):
  'moe_gate'  [R, H] x @ wi_gate          'moe_up' [R, H] x @ wi_up
  'ffn1'      [R, H] the activation output (Praxis's name for the first FFN layer's output)
  'ffn2'      [R, M] the down projection output (Praxis's name for the second FFN layer)
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig


def expert_ffn(rows, group_sizes, wi_gate, wi_up, wo, config: MoEConfig, *, backend="auto"):
    """rows: [R, M]; group_sizes: [E]; wi_*: [E, M, H]; wo: [E, H, M] -> [R, M].

    Rows past sum(group_sizes) come out zero. Weights are cast to rows.dtype.
    """
    dt = rows.dtype
    up = checkpoint_name(ops.grouped_gemm(rows, wi_up.astype(dt), group_sizes, backend=backend),
                         "moe_up")
    if config.gated:
        gate = checkpoint_name(
            ops.grouped_gemm(rows, wi_gate.astype(dt), group_sizes, backend=backend), "moe_gate")
        act = ops.swiglu(gate, up, act=config.activation, backend=backend)
    else:
        act = ops.activation(config.activation)(up)
    act = checkpoint_name(act, "ffn1")
    out = ops.grouped_gemm(act, wo.astype(dt), group_sizes, backend=backend)
    return checkpoint_name(out, "ffn2")
