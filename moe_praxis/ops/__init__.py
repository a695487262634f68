"""Primitives with interchangeable backends, in three layers.

1. Per op family, one public module: the pure-JAX reference (the CPU path and the test oracle)
   and the public op (a custom_vjp taking explicit static arguments), with its CUDA lowering
   (FFI calls, custom_partitioning, abstract shapes) beside it: `aux_loss`, `router`, `swiglu`,
   `permute`, `expert_sort`, `combine`, `grouped_gemm` (+ `grouped_gemm_tiles`, its kernel configurations and rule),
   `gate_up` and `dswiglu` (swiglu_down: dSwiGLU in the down projection's dgrad epilogue),
   `regather` (grouped GEMMs over permuted rows that gather them again in the backward; the
   fused gate/up op's variant, `gate_up_swiglu_regathered`, is in `gate_up`).
2. `backend`: the device query, each op's compute-capability requirement, 'auto' | 'xla' |
   'cuda' resolution (once per block), the one warn-once, `backend_info()`.
3. `_library` (private): the kernel library's table, path and environment variable, loading
   and FFI registration on first use, the FFI call helper.

`fp8/` is the blockwise FP8 recipe (MoEConfig.fp8), one subpackage: `fp8.recipe` the FP8
grouped GEMM's pure-JAX reference and its CUDA path, `fp8.quant` its quantizers and the FP8
kernels' operand layouts, `fp8.fused` the SwiGLU and permute that also write their output in
FP8, `fp8.gemm` the FP8 grouped GEMM kernels' wrappers, `fp8.weights` the FP8 form of a weight
made beforehand, `fp8.mixed` the per-GEMM bf16 / FP8 mix and `fp8.rule` the rule choosing it.
`vma` holds the shard_map typing helpers. Importing this package loads no shared library.
"""

from moe_praxis.ops import backend, fp8, vma
from moe_praxis.ops.aux_loss import aux_loss, aux_loss_reference
from moe_praxis.ops.backend import backend_info, resolve_backend
from moe_praxis.ops.combine import combine, combine_reference
from moe_praxis.ops.expert_sort import expert_sort, expert_sort_reference
from moe_praxis.ops.gate_up import (gate_up_swiglu, gate_up_swiglu_regathered, interleave_gate_up,
                                    split_gate_up)
from moe_praxis.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moe_praxis.ops.permute import (permute, permute_index, permute_pair, permute_reference,
                                    unpermute, unpermute2_reference, unpermute_reference)
from moe_praxis.ops.regather import regathered_gemms, regathered_gemms_reference
from moe_praxis.ops.router import route, router_reference
from moe_praxis.ops.swiglu import activation, named_gate_up, swiglu, swiglu_reference
from moe_praxis.ops.dswiglu import gate_up_swiglu_down, swiglu_down

__all__ = [
    "activation",
    "aux_loss",
    "aux_loss_reference",
    "backend",
    "backend_info",
    "combine",
    "combine_reference",
    "expert_sort",
    "expert_sort_reference",
    "fp8",
    "gate_up_swiglu",
    "gate_up_swiglu_down",
    "gate_up_swiglu_regathered",
    "grouped_gemm",
    "grouped_gemm_reference",
    "interleave_gate_up",
    "named_gate_up",
    "permute",
    "permute_index",
    "permute_pair",
    "permute_reference",
    "regathered_gemms",
    "regathered_gemms_reference",
    "resolve_backend",
    "route",
    "router_reference",
    "split_gate_up",
    "swiglu",
    "swiglu_down",
    "swiglu_reference",
    "unpermute",
    "unpermute2_reference",
    "unpermute_reference",
    "vma",
]
