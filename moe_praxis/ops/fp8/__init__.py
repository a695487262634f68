"""The blockwise FP8 recipe of the expert GEMMs (MoEConfig.fp8='blockwise'), one subpackage.

  recipe   the FP8 grouped GEMM: its pure-JAX reference, its CUDA path, the GEMMs sharing one
           lhs, quantize-before-gather (DeepSeek-V3's recipe; the module doc has the math)
  quant    the quantizers and the operand layouts the FP8 kernels read (L1, L2, L3)
  fused    the SwiGLU forward / backward and the permute writing their output in FP8 too
  gemm     the FP8 grouped GEMM kernels' wrappers, operand layouts and references
  weights  the FP8 form of a weight made beforehand (Fp8Weight) and the GEMMs that read it
  mixed    one weight's GEMMs, each in FP8 or bf16 (MoEConfig.fp8_gemms)
  rule     the measured per-GEMM rule choosing FP8 or bf16, and whether a form pays
"""

from moe_praxis.ops.fp8 import fused, gemm, mixed, quant, recipe, rule, weights

__all__ = ["fused", "gemm", "mixed", "quant", "recipe", "rule", "weights"]
