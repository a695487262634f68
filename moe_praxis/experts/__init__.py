"""Experts: grouped GEMMs gate/up -> activation -> down over expert-sorted rows.

Letters: R rows, M d_model, H d_ff, E experts (local experts under expert parallelism).
A gated expert computes act(x @ wi_gate) * (x @ wi_up) @ wo (SwiGLU with silu); a plain one
act(x @ wi_up) @ wo. Group sizes stay on the device.

The implementations are registry entries (`EXPERTS`, in order of preference; each a
variants.Entry of its own module: `bf16`, `blockwise` (FP8)), all with one
signature: `run(rows: variants.Rows, group_sizes [E], weights, config, *, backend, row_weights)
-> [R, M]`. weights: the expert weights of the parameter tree (moe.param_shapes: wi_up,
wi_gate if gated [E, M, H], or wi_gate_up [E, M, 2H] with config.fuse_gate_up; wo [E, H, M];
FP8_GATHER / FP8_WEIGHTS where the FP8 GEMMs gather or read an FP8 form). Rows past
sum(group_sizes) come out zero; weights are cast to the rows' dtype. row_weights: optional [R]
float32 routing weight of each row, multiplied into the activation (the output is then
w[r] * FFN(rows[r]), the down projection being linear, so the combine is a plain unpermute).
moe_praxis.plan picks the entry once per call; `expert_ffn` picks it for a direct call.

With config.fuse_gate_up the two projections are one grouped GEMM against wi_gate_up
[E, M, 2H] (interleaved columns) with the activation fused (ops.gate_up_swiglu); its gate and up
are residuals of that op, so 'moe_gate' and 'moe_up' do not exist there. With
config.fuse_swiglu_bwd the activation and the down projection are one op (ops.swiglu_down /
ops.gate_up_swiglu_down: dSwiGLU in the down projection's dgrad epilogue, the activation
recomputed there), so 'ffn1' does not exist there. On the FP8 kernels (config.fp8, gated silu,
every expert GEMM in FP8) the gate and up projections and the SwiGLU are one op
(ops.fp8.recipe.gate_up_swiglu_fp8), so 'moe_gate' and 'moe_up' do not exist there either.

Checkpoint names (for jax.checkpoint policies such as save_only_these_names):
  'moe_gate'  [R, H] x @ wi_gate          'moe_up' [R, H] x @ wi_up
  'ffn1'      [R, H] the activation output (Praxis's name for the first FFN layer's output)
  'ffn2'      [R, M] the down projection output (Praxis's name for the second FFN layer)
"""

from __future__ import annotations

import jax

from moe_praxis.config import MoEConfig
from moe_praxis.experts import bf16, blockwise
from moe_praxis.experts.blockwise import quantize_expert_weights
from moe_praxis.experts.common import (ENV_STRICT_CUDNN, EXPERT_WEIGHTS, FP8_GATHER, FP8_WEIGHTS,
                                       WI, check_cudnn_fusion, cudnn_fusion_status,
                                       reads_rows_twice)
from moe_praxis.variants import Query, Rows, pick

__all__ = [
    "ENV_STRICT_CUDNN", "EXPERTS", "EXPERT_WEIGHTS", "FP8_GATHER", "FP8_WEIGHTS", "WI",
    "cudnn_fusion_status", "expert_ffn", "quantize_expert_weights", "reads_rows_twice"
]

# The registry, in order of preference: one line per expert implementation.
EXPERTS = (
    blockwise.MIXED,
    blockwise.MIXED_EMULATED,
    blockwise.KERNELS,
    blockwise.KERNELS_GATHERED,
    blockwise.EMULATED,
    bf16.GATE_UP_DOWN,
    bf16.GATE_UP,
    bf16.SWIGLU_DOWN,
    bf16.SWIGLU,
    bf16.PLAIN,
)


def expert_ffn(rows,
               group_sizes,
               weights,
               config: MoEConfig,
               *,
               backend="auto",
               row_weights=None,
               rows_fp8=None,
               rows_up=None):
    """The experts on rows [R, M], outside a moe_block: the implementation the
    registry picks for these arguments (module doc) -> [R, M]. moe_block resolves its plan once
    instead (moe_praxis.plan) and calls the chosen entry.

    With config.use_cudnn_fusion where cuDNN's fusion is unusable: warns once per reason
    (RuntimeWarning naming it and the fallback) and runs the fallback; with
    MOE_PRAXIS_STRICT_CUDNN_FUSION=1 raises instead.
    rows_fp8: optional (q, s_t), the rows' FP8 operand (sort.dispatch_rows_fp8), used by the FP8
    kernels instead of quantizing the rows again.
    rows_up: optional, the rows again (equal to rows; sort.dispatch_rows_pair's second) for the
    up projection, only where reads_rows_twice(config) (elsewhere it is an error).
    """
    if rows_up is not None and not reads_rows_twice(config):
        raise ValueError("expert_ffn: rows_up is only for two projections reading the rows "
                         "(gated, fuse_gate_up=False, fp8=None); this config reads them once")
    check_cudnn_fusion(config, backend)
    given = Rows(rows=rows, rows_up=rows_up, rows_fp8=rows_fp8)
    query = Query(config=config,
                  backend=backend,
                  ep_size=1,
                  tp=False,
                  x=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
                  weights={
                      n: jax.ShapeDtypeStruct(w.shape, rows.dtype)
                      for n, w in weights.items() if n in WI + ("wo", )
                  },
                  fp8_gather=FP8_GATHER in weights,
                  fp8_given=FP8_WEIGHTS in weights)
    choice = pick(EXPERTS, query, "expert implementation")
    return choice.entry.run(given,
                            group_sizes,
                            weights,
                            config,
                            backend=backend,
                            row_weights=row_weights)
