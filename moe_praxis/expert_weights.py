"""The routed experts' weights on the mesh: their PartitionSpecs (with the FP8 form made
beforehand), the all-gather over fsdp into one EP rank's experts, and the check of an FP8 form
passed in with the parameters.

Letters: M d_model, H d_ff (H / tp on one device), E experts, El = E / ep experts of one EP
rank. The shared experts' weights are gathered in moe_praxis.shared; the parameter tree's
shapes are moe_praxis.params'; where each weight lives is resources.EPLayout.weight_specs.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from moe_praxis.config import MoEConfig
from moe_praxis.experts import EXPERT_WEIGHTS, FP8_GATHER, FP8_WEIGHTS
from moe_praxis.ops import vma
from moe_praxis.ops.fp8 import rule as fp8_rule, weights as fp8_weights
from moe_praxis.resources import EPLayout

# The routed experts' parameters, in the order they are gathered (wi_gate_up: fuse_gate_up).
GATHERED = ("wi_gate", "wi_up", "wi_gate_up", "wo")


def param_specs(layout: EPLayout, params: dict) -> dict:
    """The PartitionSpec tree of params: layout.weight_specs, and for the FP8 form of a weight
    of spec P(e, k, n) q and s P(e, k, n) (whole blocks per shard), qt P(e, n, k)."""
    specs = layout.weight_specs
    out = {name: specs[name] for name in params if name != FP8_WEIGHTS}
    if FP8_WEIGHTS in params:
        fws = {}
        for name, fw in params[FP8_WEIGHTS].items():
            e, k, n = tuple(specs[name]) + (None, ) * (3 - len(specs[name]))
            fws[name] = fp8_weights.Fp8Weight(q=P(e, k, n),
                                              s=P(e, k, n),
                                              qt=None if fw.qt is None else P(e, n, k))
        out[FP8_WEIGHTS] = fws
    return out


def gather_expert_weights(params, layout: EPLayout, config: MoEConfig) -> dict:
    """Expert weights all-gathered over fsdp: wi [El, M, H/tp], wo [El, H/tp, M], marked
    varying over the token and tp axes like the rows they multiply (a custom_vjp grouped GEMM
    returns per-shard weight gradients, which autodiff of the cast sums back).

    With config.fp8 and fp8_quantize_before_gather the shards stay local and the weights get
    an entry experts.FP8_GATHER {name: (fsdp axes, dim)}: the FP8 GEMM quantizes each shard and
    gathers the e4m3 data and scales itself (ops.fp8.recipe.gathered_fp8_grouped_gemm). A weight whose
    FP8 form came in (params[FP8_WEIGHTS], experts.quantize_expert_weights) is always gathered
    in that form (bitwise the same as either order). Where config.fp8_gemms runs some expert
    GEMMs in bf16, the weights are gathered in their dtype (and a given FP8 form in FP8)."""
    out, gathers = {}, {}
    given = dict(params.get(FP8_WEIGHTS, {}))
    all_fp8 = all(c.all for c in config.fp8_choices().values())
    for name in GATHERED:
        if name not in params:
            continue
        w = params[name]
        if layout.fsdp_axes:
            if layout.fsdp_dim == "expert":
                dim = 0
            else:
                dim = 1 if name.startswith("wi") else 2
            if all_fp8 and config.fp8 is not None and (config.fp8_quantize_before_gather
                                                       or name in given):
                gathers[name] = (layout.fsdp_axes, dim)
            else:
                # some of its GEMMs in bf16 (config.fp8_gemms): the master weight gathered for
                # them, its FP8 form, when given, gathered in FP8 for the others
                w = jax.lax.all_gather(w, layout.fsdp_axes, axis=dim, tiled=True)
                if name in given:
                    given[name] = fp8_weights.all_gather(given[name], layout.fsdp_axes, dim)
        out[name] = vma.vary(w, layout.token_axes + layout.tp_axes)
    if gathers:
        out[FP8_GATHER] = gathers
    if given:
        axes = layout.token_axes + layout.tp_axes
        out[FP8_WEIGHTS] = jax.tree.map(lambda a: vma.vary(a, axes), given)
    return out


def check_fp8_weights(params: dict, config: MoEConfig) -> None:
    """params[FP8_WEIGHTS], when present, holds the FP8 form of expert weights these params
    have, each of its weight's shape (ops.fp8.weights.check_companion), and config.fp8 is set."""
    if FP8_WEIGHTS not in params:
        return
    if config.fp8 is None:
        raise ValueError(f"params carry {FP8_WEIGHTS!r} (FP8 expert weights) but the config has "
                         "fp8=None; pass the plain parameters or set fp8='blockwise'")
    for name, fw in params[FP8_WEIGHTS].items():
        if name not in EXPERT_WEIGHTS or name not in params:
            raise ValueError(f"params[{FP8_WEIGHTS!r}] has {name!r}; valid: the expert weights "
                             f"of these params, {[n for n in EXPERT_WEIGHTS if n in params]}")
        fp8_weights.check_companion(params[name].shape, fw, name)


def rows_per_local_expert(num_tokens: int, layout: EPLayout, top_k: int) -> float:
    """The rows one device's experts get on average in a call of num_tokens (global) tokens:
    its T / token shards tokens times top_k, over its E / ep experts."""
    return num_tokens / layout.num_token_shards * top_k / layout.experts_per_rank


def fp8_for_call(config: MoEConfig, params: dict, rows_per_expert: float) -> tuple[MoEConfig, dict]:
    """(the config a moe_block call runs, {expert weight: ops.fp8.rule.Fp8Gemms} of the GEMMs
    it runs in FP8; {} without config.fp8).

    Where the call quantizes its own weights (no FP8 form in params) and the form would serve
    too few rows per expert to pay (ops.fp8.rule.form_pays under config.fp8_gemms), the call
    runs the bf16 layer: fp8=None, every GEMM NONE. A form passed in is used (the caller chose
    to make it; moe_block cannot see how many calls share it)."""
    if config.fp8 is None:
        return config, {}
    choices = config.fp8_choices()
    if FP8_WEIGHTS in params or fp8_rule.form_pays(config.fp8_gemms, rows_per_expert):
        return config, choices
    return dataclasses.replace(config, fp8=None), dict.fromkeys(choices, fp8_rule.NONE)
