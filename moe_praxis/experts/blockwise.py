"""The experts with config.fp8='blockwise': the three expert GEMMs in blockwise FP8 (ops.fp8:
forward, dgrad and wgrad), one registry entry per way of running them, and
`quantize_expert_weights`, the weights' FP8 form made once per optimizer step.

Letters: R rows, M d_model, H d_ff, E experts (local experts under expert parallelism).
Every entry runs `run(rows: variants.Rows, group_sizes [E], weights, config, *, backend,
row_weights) -> [R, M]` (moe_praxis.experts states the contract). Where the FP8 GEMMs run
the pure-JAX emulation, choosing the entry warns once (the numerics of the recipe, not its
speed).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.experts.common import EXPERT_WEIGHTS, FP8_GATHER, FP8_WEIGHTS, activation_reference
from moe_praxis.ops import backend as ops_backend
from moe_praxis.ops.fp8 import (recipe as fp8, fused as fp8_fused, mixed as fp8_mixed, weights as
                                fp8_weights)
from moe_praxis.variants import Entry, Query, Rows


def quantize_expert_weights(params: dict, config: MoEConfig, *, transposed=None) -> dict:
    """params with their expert weights' FP8 form added under FP8_WEIGHTS ('fp8_weights'):
    {name: Fp8Weight(q, s, qt)} for wi_gate (gated), wi_up and wo (ops.fp8.weights: e4m3
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


def fp8_impl(q: Query) -> str:
    """'' without config.fp8, else where its GEMMs run: 'cuda' (the FP8 grouped GEMM kernels)
    or 'xla' (the pure-JAX emulation, warned about once)."""
    if q.config.fp8 is None:
        return ""
    impl = fp8.resolve(q.backend)
    if impl == "xla":
        ops_backend.warn_once(
            "MoEConfig.fp8='blockwise' runs the pure-JAX emulation of FP8 GEMMs (ops.fp8): the "
            "numerics of the recipe, not its speed (the FP8 grouped GEMM kernels need "
            f"kernel_backend 'cuda' on compute capability 9.0; the backend here: {q.backend!r}).",
            RuntimeWarning)
    return impl


def _every_gemm_fp8(config: MoEConfig) -> bool:
    return all(c.all for c in config.fp8_choices().values())


def _mixed(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights,
           kernels: bool):
    """config.fp8_gemms where some expert GEMMs run in bf16 (ops.fp8.rule): each weight's
    GEMMs through ops.fp8.mixed, its FP8 ones reading its FP8 form (made beforehand or here),
    its bf16 ones the master weight (gathered whole under FSDP). With the FP8 kernels
    (`kernels`) the forwards read the rows' FP8 operand (the permute's, or quantized here once)
    and the SwiGLU writes the down projection's when its forward runs in FP8."""
    choices = config.fp8_choices()
    given = weights.get(FP8_WEIGHTS, {})
    x, rows_fp8 = rows.rows, rows.rows_fp8
    dt = x.dtype
    if kernels and rows_fp8 is None and choices["wi_up"].fwd:
        rows_fp8 = fp8.quantize_rows(jax.lax.stop_gradient(x), backend="auto")

    def gemm(lhs, name, lhs_fp8):
        return fp8_mixed.mixed_grouped_gemm(lhs,
                                            weights[name],
                                            group_sizes,
                                            choices[name],
                                            fw=given.get(name),
                                            lhs_fp8=lhs_fp8,
                                            backend=backend)

    up = gemm(x, "wi_up", rows_fp8)
    gate, up = ops.named_gate_up(gemm(x, "wi_gate", rows_fp8) if config.gated else None, up)
    act_fp8 = None
    if kernels and config.gated and config.activation == "silu" and choices["wo"].fwd:
        act, *act_fp8 = fp8_fused.swiglu_fp8(gate, up, row_weights, backend="auto")
    elif kernels and config.gated:
        act = ops.swiglu(gate, up, row_weights, act=config.activation, backend=backend)
    else:
        act = activation_reference(gate, up, row_weights, config).astype(dt)
    act = checkpoint_name(act, "ffn1")
    return checkpoint_name(gemm(act, "wo", act_fp8), "ffn2")


def _kernels(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights):
    """The FP8 kernels' FFN: one FP8 operand of the rows for the gate and up projections (the
    permute's, rows.rows_fp8, or quantized here once), the SwiGLU writing the down projection's
    FP8 operand in its pass (silu; other activations quantize their output after it). With silu
    the gate and up projections and the SwiGLU are one op (ops.fp8.recipe.gate_up_swiglu_fp8: its
    backward's SwiGLU writes the dgrads' FP8 operands), so 'moe_gate' and 'moe_up' do not exist
    there."""
    del backend  # the FP8 kernels' ops resolve 'auto' to the kernels this entry was chosen for
    x, rows_fp8 = rows.rows, rows.rows_fp8
    if config.gated and config.activation == "silu":
        act, *act_fp8 = fp8.gate_up_swiglu_fp8(x, rows_fp8, weights["wi_gate"], weights["wi_up"],
                                               group_sizes, row_weights,
                                               _given(weights, ("wi_gate", "wi_up")))
        act = checkpoint_name(act, "ffn1")
        out = fp8.fp8_gemms_shared_lhs(act, act_fp8, (weights["wo"], ), group_sizes,
                                       _given(weights, ("wo", )))[0]
        return checkpoint_name(out, "ffn2")
    names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
    outs = fp8.fp8_gemms_shared_lhs(x, rows_fp8, tuple(weights[n] for n in names), group_sizes,
                                    _given(weights, names))
    gate, up = ops.named_gate_up(outs[0] if config.gated else None, outs[-1])
    act = activation_reference(gate, up, row_weights, config).astype(x.dtype)
    act = checkpoint_name(act, "ffn1")
    out = fp8.fp8_gemms_shared_lhs(act, None, (weights["wo"], ), group_sizes,
                                   _given(weights, ("wo", )))[0]
    return checkpoint_name(out, "ffn2")


def _given(weights, names):
    """The (q, qt, s) of each name's FP8 weight made beforehand (FP8_WEIGHTS), else None."""
    given = weights.get(FP8_WEIGHTS, {})
    return tuple((given[n].q, given[n].qt, given[n].s) if n in given else None for n in names)


def _per_weight(rows: Rows, group_sizes, weights, config: MoEConfig, *, row_weights, impl: str):
    """Each expert GEMM on its own (ops.fp8 on path `impl`), reading the weight's FP8 form where
    it came in, quantizing and all-gathering its shards where the weights carry FP8_GATHER;
    the activation and the routing weight in float32 between them."""
    x = rows.rows
    gathers = weights.get(FP8_GATHER, {})
    given = weights.get(FP8_WEIGHTS, {})

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

    up = gemm(x, "wi_up")
    gate, up = ops.named_gate_up(gemm(x, "wi_gate") if config.gated else None, up)
    act = checkpoint_name(
        activation_reference(gate, up, row_weights, config).astype(x.dtype), "ffn1")
    return checkpoint_name(gemm(act, "wo"), "ffn2")


def _choose(impl: str, every: bool, gathered, reason: str):
    """choose() of an entry: config.fp8 on path `impl`, every expert GEMM in FP8 or not, and
    (None: either) the FP8 GEMMs gathering their weights themselves."""

    def choose(q: Query) -> str:
        if fp8_impl(q) != impl or _every_gemm_fp8(q.config) != every:
            return ""
        return reason if gathered is None or q.fp8_gather == gathered else ""

    return choose


def _run_mixed(kernels: bool):
    return lambda rows, group_sizes, weights, config, *, backend, row_weights: _mixed(
        rows,
        group_sizes,
        weights,
        config,
        backend=backend,
        row_weights=row_weights,
        kernels=kernels)


def _run_per_weight(impl: str):
    return lambda rows, group_sizes, weights, config, *, backend, row_weights: _per_weight(
        rows, group_sizes, weights, config, row_weights=row_weights, impl=impl)


MIXED = Entry(
    "fp8_mixed",
    _choose("cuda", False, None, "fp8_gemms runs some expert GEMMs in bf16; the FP8 kernels run "
            "the others"), _run_mixed(True))
MIXED_EMULATED = Entry(
    "fp8_mixed_emulated",
    _choose("xla", False, None, "fp8_gemms runs some expert GEMMs in bf16; the others in the "
            "pure-JAX FP8 emulation"), _run_mixed(False))
KERNELS = Entry(
    "fp8_kernels",
    _choose(
        "cuda", True, False, "fp8: every expert GEMM on the FP8 kernels, the rows' FP8 "
        "operand shared by gate and up"), _kernels)
KERNELS_GATHERED = Entry(
    "fp8_kernels_gathered",
    _choose(
        "cuda", True, True, "fp8 with fp8_quantize_before_gather under fsdp: each FP8 GEMM "
        "quantizes and gathers its weight shards"), _run_per_weight("cuda"))
EMULATED = Entry(
    "fp8_emulated",
    _choose("xla", True, None, "fp8 where the FP8 kernels do not run: the pure-JAX emulation"),
    _run_per_weight("xla"))
