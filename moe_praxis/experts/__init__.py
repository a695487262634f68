"""Experts: grouped GEMMs gate/up -> activation -> down over expert-sorted rows.

Letters: R rows, M d_model, H d_ff, E experts (local experts under expert parallelism).
A gated expert computes act(x @ wi_gate) * (x @ wi_up) @ wo (SwiGLU with silu); a plain one
act(x @ wi_up) @ wo. Group sizes stay on the device.

With config.fuse_gate_up the two projections are one grouped GEMM against wi_gate_up
[E, M, 2H] (interleaved columns) with the activation fused (ops.gate_up_swiglu); its gate and up
are residuals of that op, so 'moe_gate' and 'moe_up' do not exist there. With
config.fuse_swiglu_bwd the activation and the down projection are one op (ops.swiglu_down /
ops.gate_up_swiglu_down: dSwiGLU in the down projection's dgrad epilogue, the activation
recomputed there), so 'ffn1' does not exist there. On the FP8 kernels (config.fp8, gated silu,
every expert GEMM in FP8) the gate and up projections and the SwiGLU are one op
(ops.fp8.gate_up_swiglu_fp8), so 'moe_gate' and 'moe_up' do not exist there either.

Checkpoint names (for jax.checkpoint policies such as save_only_these_names):
  'moe_gate'  [R, H] x @ wi_gate          'moe_up' [R, H] x @ wi_up
  'ffn1'      [R, H] the activation output (Praxis's name for the first FFN layer's output)
  'ffn2'      [R, M] the down projection output (Praxis's name for the second FFN layer)
"""

from __future__ import annotations

import importlib
import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.ops import backend as ops_backend
from moe_praxis.ops import fp8, fp8_fused, fp8_mixed, fp8_weights
from moe_praxis.ops.gate_up import gathered_unsupported
from moe_praxis.ops.gathered_gemm import gather_unsupported

# Set to 1: use_cudnn_fusion=True where the fusion cannot run is an error, not a warning (for
# jobs that must not silently run another kernel than the one asked for).
ENV_STRICT_CUDNN = "MOE_PRAXIS_STRICT_CUDNN_FUSION"
# weights key: {name: (fsdp axes, dim)} of expert weights still fsdp-sharded, which the FP8
# GEMMs quantize and then all-gather (MoEConfig.fp8_quantize_before_gather)
FP8_GATHER = "fp8_gather"
# params / weights key: {name: ops.fp8_weights.Fp8Weight} of the expert weights quantized
# beforehand (quantize_expert_weights); the FP8 GEMMs read them instead of quantizing
FP8_WEIGHTS = "fp8_weights"
EXPERT_WEIGHTS = ("wi_gate", "wi_up", "wo")
# the first projection's weights (separate, or fused with fuse_gate_up)
WI = ("wi_gate", "wi_up", "wi_gate_up")


def quantize_expert_weights(params: dict, config: MoEConfig, *, transposed=None) -> dict:
    """params with their expert weights' FP8 form added under FP8_WEIGHTS ('fp8_weights'):
    {name: Fp8Weight(q, s, qt)} for wi_gate (gated), wi_up and wo (ops.fp8_weights: e4m3
    values, 128x128 block scales shared by W and W^T), one pass over each weight.

    Made once per optimizer step and passed to every moe_block call of that step (every
    micro-batch), it replaces the quantization each call would do: the outputs and every
    gradient are bitwise those of quantizing inside, the gradients still go to the master
    weights (params' own entries) and none to the FP8 form. Works on globally sharded
    weights (each device quantizes its blocks; under FSDP moe_block gathers the e4m3 form).
    transposed: also write qt [E, N, K] (the CUDA forward reads it); None: where the FP8
    kernels run (config.kernel_backend resolves to them).
    """
    if config.fp8 is None:
        raise ValueError("quantize_expert_weights needs MoEConfig.fp8='blockwise'; this config "
                         "has fp8=None")
    if transposed is None:
        transposed = fp8.resolve(config.kernel_backend) == "cuda"
    fws = {
        name: fp8_weights.quantize(params[name], transposed=transposed)
        for name in EXPERT_WEIGHTS if name in params
    }
    return {**params, FP8_WEIGHTS: fws}


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


def _warn_cudnn_fallback(backend: str) -> None:
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


def fp8_kernels(config: MoEConfig, backend: str) -> bool:
    """True where config.fp8 runs the FP8 kernels (rather than the pure-JAX emulation): the
    dispatch then writes the rows' FP8 operand in its permute (sort.dispatch_rows_fp8,
    expert_ffn's rows_fp8)."""
    return config.fp8 is not None and fp8.resolve(backend) == "cuda"


def reads_rows_twice(config: MoEConfig) -> bool:
    """True where expert_ffn's gate and up projections are two GEMMs reading the rows (gated,
    separate wi_gate / wi_up, bf16): the dispatch then gives the rows twice
    (sort.dispatch_rows_pair) so that their two cotangents are summed in the permute's
    backward, and expert_ffn takes the second as rows_up."""
    return config.gated and not config.fuse_gate_up and config.fp8 is None


def gathers_rows(config: MoEConfig, x, weights, backend: str) -> bool:
    """True where expert_ffn reads the rows from x by index (config.gather_rows; `tokens`):
    on the XLA path, and on CUDA where the gathered kernels run these weights (elsewhere on
    CUDA: False, with a warning naming why, and the block permutes as without the flag)."""
    if not config.gather_rows:
        return False
    if ops_backend.op_backend(backend, "grouped_gemm") == "xla":
        return True
    # the weights as expert_ffn casts them (shapes and dtypes only: nothing traced)
    cast = {n: jax.ShapeDtypeStruct(w.shape, x.dtype) for n, w in weights.items() if n in WI}
    if config.fuse_gate_up:
        why = gathered_unsupported(x, cast["wi_gate_up"], config.activation, "cuda")
    else:
        names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
        why = gather_unsupported(x, tuple(cast[n] for n in names), "cuda")
    if why:
        ops_backend.warn_once(
            f"MoEConfig.gather_rows=True is not honoured here: {why}. The dispatch permutes the "
            "rows instead.", RuntimeWarning)
    return not why


def expert_ffn(rows,
               group_sizes,
               weights,
               config: MoEConfig,
               *,
               backend="auto",
               row_weights=None,
               rows_fp8=None,
               rows_up=None,
               tokens=None):
    """rows: [R, M]; group_sizes: [E]; weights: the expert weights of the parameter tree
    (moe.param_shapes: wi_up, wi_gate if gated [E, M, H], or wi_gate_up [E, M, 2H] with
    config.fuse_gate_up; wo [E, H, M]; other keys ignored) -> [R, M].

    Rows past sum(group_sizes) come out zero. Weights are cast to rows.dtype.
    row_weights: optional [R] float32 routing weight of each row, multiplied into the
    activation (fused into the SwiGLU kernel on the 'cuda' backend): the output is then
    w[r] * FFN(rows[r]) (the down projection is linear), so the combine is a plain unpermute.
    With config.use_cudnn_fusion where cuDNN's fusion is unusable: warns once per reason
    (RuntimeWarning naming it and the fallback) and runs the fallback; with
    MOE_PRAXIS_STRICT_CUDNN_FUSION=1 raises instead.
    rows_fp8: optional (q, s_t), the rows' FP8 operand (sort.dispatch_rows_fp8), used by the FP8
    kernels (config.fp8, fp8_kernels) instead of quantizing the rows again.
    rows_up: optional, the rows again (equal to rows; sort.dispatch_rows_pair's second) for the
    up projection, only where reads_rows_twice(config) (elsewhere it is an error).
    tokens: optional (x [T, M], row_map [R], index) to read the rows from by index instead
    (rows None; gathers_rows(config, ...)): ops.gathered_gemm's row map and permute index.
    """
    if (tokens is None) == (rows is None):
        raise ValueError("expert_ffn takes the rows or tokens=(x, row_map, index), one of them")
    if tokens is not None and not config.gather_rows:
        raise ValueError("expert_ffn: tokens are only read with MoEConfig.gather_rows=True")
    if rows_up is not None and not reads_rows_twice(config):
        raise ValueError("expert_ffn: rows_up is only for two projections reading the rows "
                         "(gated, fuse_gate_up=False, fp8=None); this config reads them once")
    if config.use_cudnn_fusion:
        _warn_cudnn_fallback(backend)
    if config.fp8 is not None:
        return _fp8_expert_ffn(rows, group_sizes, weights, config, row_weights, backend, rows_fp8)
    dt = (rows if tokens is None else tokens[0]).dtype
    wo = weights["wo"]
    down = dict(act=config.activation, backend=backend)  # fuse_swiglu_bwd's ops' options
    if config.fuse_gate_up and config.fuse_swiglu_bwd:
        w_gate_up = weights["wi_gate_up"].astype(dt)
        out = ops.gate_up_swiglu_down(rows, w_gate_up, wo.astype(dt), group_sizes, row_weights,
                                      **down)
        return checkpoint_name(out, "ffn2")
    if config.fuse_gate_up:
        act = checkpoint_name(
            _fused_gate_up(rows, tokens, weights, group_sizes, row_weights, config, backend),
            "ffn1")
        return checkpoint_name(ops.grouped_gemm(act, wo.astype(dt), group_sizes, backend=backend),
                               "ffn2")
    gate, up = _projections(rows, rows_up, tokens, weights, group_sizes, config, backend)
    if config.gated:
        if config.fuse_swiglu_bwd:
            out = ops.swiglu_down(gate, up, wo.astype(dt), group_sizes, row_weights, **down)
            return checkpoint_name(out, "ffn2")
        act = ops.swiglu(gate, up, row_weights, act=config.activation, backend=backend)
    else:
        act = ops.activation(config.activation)(up)
        if row_weights is not None:
            act = (act.astype(jnp.float32) * row_weights.astype(jnp.float32)[:, None]).astype(dt)
    act = checkpoint_name(act, "ffn1")
    out = ops.grouped_gemm(act, wo.astype(dt), group_sizes, backend=backend)
    return checkpoint_name(out, "ffn2")


def _fused_gate_up(rows, tokens, weights, group_sizes, row_weights, config: MoEConfig, backend):
    """The fused gate/up projection's activation [R, H], from the rows or (tokens) from x by
    index."""
    opts = dict(act=config.activation, backend=backend)
    if tokens is None:
        return ops.gate_up_swiglu(rows, weights["wi_gate_up"].astype(rows.dtype), group_sizes,
                                  row_weights, **opts)
    x, row_map, index = tokens
    return ops.gathered_gate_up_swiglu(x,
                                       row_map,
                                       weights["wi_gate_up"].astype(x.dtype),
                                       group_sizes,
                                       row_weights,
                                       index=index,
                                       **opts)


def _projections(rows, rows_up, tokens, weights, group_sizes, config: MoEConfig, backend):
    """(gate or None where not gated, up), each [R, H] under its checkpoint name: grouped GEMMs
    of the rows (rows_up for up where given) or (tokens) one gathered op reading x by index."""
    names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
    if tokens is not None:
        x, row_map, index = tokens
        outs = ops.gathered_gemm(x,
                                 row_map,
                                 tuple(weights[n].astype(x.dtype) for n in names),
                                 group_sizes,
                                 backend=backend,
                                 index=index)
    else:
        lhs = {"wi_gate": rows, "wi_up": rows if rows_up is None else rows_up}
        outs = tuple(
            ops.grouped_gemm(lhs[n], weights[n].astype(rows.dtype), group_sizes, backend=backend)
            for n in names)
    up = checkpoint_name(outs[-1], "moe_up")
    gate = checkpoint_name(outs[0], "moe_gate") if config.gated else None
    return gate, up


def _fp8_expert_ffn(rows, group_sizes, weights, config: MoEConfig, row_weights, backend, rows_fp8):
    """config.fp8='blockwise': the three expert GEMMs in blockwise FP8 (ops.fp8, forward, dgrad
    and wgrad: the FP8 grouped GEMM kernels where `backend` resolves to cuda, else the pure-JAX
    emulation), the activation and the routing weight in float32 between them."""
    impl = fp8.resolve(backend)
    if impl == "xla":
        ops_backend.warn_once(
            "MoEConfig.fp8='blockwise' runs the pure-JAX emulation of FP8 GEMMs (ops.fp8): the "
            "numerics of the recipe, not its speed (the FP8 grouped GEMM kernels need "
            f"kernel_backend 'cuda' on compute capability 9.0; the backend here: {backend!r}).",
            RuntimeWarning)
    dt = rows.dtype
    gathers = weights.get(FP8_GATHER, {})
    given = weights.get(FP8_WEIGHTS, {})
    choices = config.fp8_choices()
    if not all(c.all for c in choices.values()):
        return _mixed_ffn(rows, group_sizes, weights, config, row_weights, backend, rows_fp8,
                          impl == "cuda")
    if impl == "cuda" and not gathers:
        return _fp8_kernel_ffn(rows, group_sizes, weights, config, row_weights, rows_fp8)

    def gemm(lhs, name):
        if name in given and name in gathers:
            axes, dim = gathers[name]
            return fp8_weights.gathered_prequantized(lhs,
                                                     weights[name],
                                                     given[name],
                                                     group_sizes,
                                                     axes,
                                                     dim,
                                                     backend=impl)
        if name in given:
            return fp8_weights.prequantized_fp8_grouped_gemm(lhs,
                                                             weights[name],
                                                             given[name],
                                                             group_sizes,
                                                             backend=impl)
        if name in gathers:
            axes, dim = gathers[name]
            return fp8.gathered_fp8_grouped_gemm(lhs,
                                                 weights[name],
                                                 group_sizes,
                                                 axes,
                                                 dim,
                                                 backend=impl)
        return fp8.fp8_grouped_gemm(lhs, weights[name], group_sizes, backend=impl)

    up = checkpoint_name(gemm(rows, "wi_up"), "moe_up")
    gate = checkpoint_name(gemm(rows, "wi_gate"), "moe_gate") if config.gated else None
    act = checkpoint_name(_activation_reference(gate, up, row_weights, config).astype(dt), "ffn1")
    return checkpoint_name(gemm(act, "wo"), "ffn2")


def _mixed_ffn(rows, group_sizes, weights, config: MoEConfig, row_weights, backend, rows_fp8,
               kernels: bool):
    """config.fp8_gemms where some expert GEMMs run in bf16 (ops.fp8_rule): each weight's
    GEMMs through ops.fp8_mixed, its FP8 ones reading its FP8 form (made beforehand or here),
    its bf16 ones the master weight (moe.py gathers it whole under FSDP). With the FP8 kernels
    (`kernels`) the forwards read the rows' FP8 operand (the permute's, or quantized here once)
    and the SwiGLU writes the down projection's when its forward runs in FP8."""
    choices = config.fp8_choices()
    given = weights.get(FP8_WEIGHTS, {})
    dt = rows.dtype
    if kernels and rows_fp8 is None and choices["wi_up"].fwd:
        rows_fp8 = fp8.quantize_rows(jax.lax.stop_gradient(rows), backend="auto")

    def gemm(lhs, name, lhs_fp8):
        return fp8_mixed.mixed_grouped_gemm(lhs,
                                            weights[name],
                                            group_sizes,
                                            choices[name],
                                            fw=given.get(name),
                                            lhs_fp8=lhs_fp8,
                                            backend=backend)

    up = checkpoint_name(gemm(rows, "wi_up", rows_fp8), "moe_up")
    gate = checkpoint_name(gemm(rows, "wi_gate", rows_fp8), "moe_gate") if config.gated else None
    act_fp8 = None
    if kernels and config.gated and config.activation == "silu" and choices["wo"].fwd:
        act, *act_fp8 = fp8_fused.swiglu_fp8(gate, up, row_weights, backend="auto")
    elif kernels and config.gated:
        act = ops.swiglu(gate, up, row_weights, act=config.activation, backend=backend)
    else:
        act = _activation_reference(gate, up, row_weights, config).astype(dt)
    act = checkpoint_name(act, "ffn1")
    return checkpoint_name(gemm(act, "wo", act_fp8), "ffn2")


def _activation_reference(gate, up, row_weights, config: MoEConfig):
    """The activation between the FP8 GEMMs, times the routing weight (float32 math)."""
    if config.gated:
        return ops.swiglu_reference(gate, up, row_weights, act=config.activation)
    act = ops.activation(config.activation)(up.astype(jnp.float32))
    if row_weights is not None:
        act = act * row_weights.astype(jnp.float32)[:, None]
    return act


def _fp8_kernel_ffn(rows, group_sizes, weights, config: MoEConfig, row_weights, rows_fp8):
    """The FP8 kernels' FFN: one FP8 operand of the rows for the gate and up projections (the
    permute's, rows_fp8, or quantized here once), the SwiGLU writing the down projection's FP8
    operand in its pass (silu; other activations quantize their output after it). With silu
    the gate and up projections and the SwiGLU are one op (ops.fp8.gate_up_swiglu_fp8: its
    backward's SwiGLU writes the dgrads' FP8 operands), so 'moe_gate' and 'moe_up' do not exist
    there."""
    if config.gated and config.activation == "silu":
        act, *act_fp8 = fp8.gate_up_swiglu_fp8(rows, rows_fp8, weights["wi_gate"], weights["wi_up"],
                                               group_sizes, row_weights,
                                               _given(weights, ("wi_gate", "wi_up")))
        act = checkpoint_name(act, "ffn1")
        out = fp8.fp8_gemms_shared_lhs(act, act_fp8, (weights["wo"], ), group_sizes,
                                       _given(weights, ("wo", )))[0]
        return checkpoint_name(out, "ffn2")
    names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
    outs = fp8.fp8_gemms_shared_lhs(rows, rows_fp8, tuple(weights[n] for n in names), group_sizes,
                                    _given(weights, names))
    up = checkpoint_name(outs[-1], "moe_up")
    gate = checkpoint_name(outs[0], "moe_gate") if config.gated else None
    act = _activation_reference(gate, up, row_weights, config).astype(rows.dtype)
    act = checkpoint_name(act, "ffn1")
    out = fp8.fp8_gemms_shared_lhs(act, None, (weights["wo"], ), group_sizes,
                                   _given(weights, ("wo", )))[0]
    return checkpoint_name(out, "ffn2")


def _given(weights, names):
    """The (q, qt, s) of each name's FP8 weight made beforehand (FP8_WEIGHTS), else None."""
    given = weights.get(FP8_WEIGHTS, {})
    return tuple((given[n].q, given[n].qt, given[n].s) if n in given else None for n in names)
