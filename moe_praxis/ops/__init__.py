"""Primitives with interchangeable backends.

Every primitive here has a pure-JAX reference that is both the CPU path and the test oracle;
CUDA kernels (kernels/, loaded by ``moe_praxis.ops.cuda``) sit behind the same functions.
"""

from moe_praxis.ops import cuda
from moe_praxis.ops.aux_loss import aux_loss, aux_loss_reference
from moe_praxis.ops.backend import backend_info, resolve_backend
from moe_praxis.ops.gate_up import gate_up_swiglu, interleave_gate_up, split_gate_up
from moe_praxis.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moe_praxis.ops.permute import permute, permute_reference, unpermute, unpermute_reference
from moe_praxis.ops.swiglu import activation, swiglu, swiglu_reference

__all__ = [
    "activation",
    "aux_loss",
    "aux_loss_reference",
    "backend_info",
    "cuda",
    "gate_up_swiglu",
    "grouped_gemm",
    "grouped_gemm_reference",
    "interleave_gate_up",
    "permute",
    "permute_reference",
    "resolve_backend",
    "split_gate_up",
    "swiglu",
    "swiglu_reference",
    "unpermute",
    "unpermute_reference",
]
