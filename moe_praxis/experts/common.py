"""What the expert implementations share: the weights' names, the FP8 keys of the weights tree,
the activation's float32 reference, and the cuDNN-fusion check (made once, by the plan).

Letters: R rows, M d_model, H d_ff.
"""

from __future__ import annotations

import importlib
import os

import jax.numpy as jnp

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.ops import backend as ops_backend

# Set to 1: use_cudnn_fusion=True where the fusion cannot run is an error, not a warning (for
# jobs that must not silently run another kernel than the one asked for).
ENV_STRICT_CUDNN = "MOE_PRAXIS_STRICT_CUDNN_FUSION"
# weights key: {name: (fsdp axes, dim)} of expert weights still fsdp-sharded, which the FP8
# GEMMs quantize and then all-gather (MoEConfig.fp8_quantize_before_gather)
FP8_GATHER = "fp8_gather"
# params / weights key: {name: ops.fp8.weights.Fp8Weight} of the expert weights quantized
# beforehand (quantize_expert_weights); the FP8 GEMMs read them instead of quantizing
FP8_WEIGHTS = "fp8_weights"
EXPERT_WEIGHTS = ("wi_gate", "wi_up", "wo")
# the first projection's weights (separate, or fused with fuse_gate_up)
WI = ("wi_gate", "wi_up", "wi_gate_up")


def reads_rows_twice(config: MoEConfig) -> bool:
    """True where the gate and up projections are two GEMMs reading the rows (gated, separate
    wi_gate / wi_up, bf16): the dispatch then gives the rows twice (sort.dispatch_rows_pair) so
    that their two cotangents are summed in the permute's backward, and the experts take the
    second as rows_up."""
    return config.gated and not config.fuse_gate_up and config.fp8 is None


def activation_reference(gate, up, row_weights, config: MoEConfig):
    """The activation between the FP8 GEMMs, times the routing weight (float32 math)."""
    if config.gated:
        return ops.swiglu_reference(gate, up, row_weights, act=config.activation)
    act = ops.activation(config.activation)(up.astype(jnp.float32))
    if row_weights is not None:
        act = act * row_weights.astype(jnp.float32)[:, None]
    return act


def cudnn_fusion_status() -> tuple[bool, str]:
    """(usable, reason) of cuDNN's fused grouped GEMM + SwiGLU (config.use_cudnn_fusion).

    It needs an SM100+ GPU and an importable `cudnn.jax` (an optional package: imported here,
    lazily, never at module import). This version of moe_praxis has no cuDNN fused path yet,
    so the answer is always False, with the first reason that applies.
    """
    dev = ops_backend.device_query()
    if dev["reason"]:
        return False, dev["reason"]
    cc = ops_backend.compute_capability()
    if cc < 100:
        return False, (f"{dev['devices'][0]['name']} has compute capability "
                       f"{cc // 10}.{cc % 10}; it needs SM100+")
    try:
        importlib.import_module("cudnn.jax")
    except ImportError as e:
        return False, f"the optional package cudnn.jax is not importable ({e})"
    return False, "this version of moe_praxis does not implement the cuDNN fused path yet"


def check_cudnn_fusion(config: MoEConfig, backend: str) -> None:
    """With config.use_cudnn_fusion where cuDNN's fusion is unusable (always, in this version):
    warns once per reason (RuntimeWarning naming it and the fallback, the `backend`'s grouped
    GEMM + SwiGLU); with MOE_PRAXIS_STRICT_CUDNN_FUSION=1 raises instead."""
    if not config.use_cudnn_fusion:
        return
    _, why = cudnn_fusion_status()
    fallback = f"the {backend!r}-backend grouped GEMM + SwiGLU"
    strict = os.environ.get(ENV_STRICT_CUDNN, "0")
    if strict not in ("0", "1"):
        raise ValueError(f"{ENV_STRICT_CUDNN}={strict!r} is invalid: use 1 (an error) or 0 / unset "
                         "(a warning)")
    if strict == "1":
        raise RuntimeError(
            f"use_cudnn_fusion=True is not honoured here: {why}; {ENV_STRICT_CUDNN}=1 "
            f"makes this an error (unset it to run {fallback} instead)")
    ops_backend.warn_once(
        f"use_cudnn_fusion=True is not honoured here: {why}. Running {fallback} instead "
        f"({ENV_STRICT_CUDNN}=1 makes this an error).", RuntimeWarning)
