"""MoEConfig: the one source of truth for the MoE block's hyperparameters and their defaults.

The defaults give Mixtral / GShard routing: softmax over all experts, top-k, the k weights
renormalised to sum to 1, SwiGLU experts, dropless. docs/config.md lists every field; a test
keeps that page and this dataclass in step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from moe_praxis.ops import routing_table
from moe_praxis.ops.fp8 import rule as fp8_rule
from moe_praxis.ops.backend import BACKENDS as KERNEL_BACKENDS
from moe_praxis.ops.routing_table import ROUTER_PRECISIONS
from moe_praxis.ops.swiglu import ACTIVATIONS

AUX_LOSS_TYPES = ("switch", "sequence", "gshard")
DROP_POLICIES = ("position", "weight")
EP_EXCHANGES = ("auto", "ragged", "padded")
FP8_RECIPES = (None, "blockwise")
FP8_BLOCK = 128  # moe_praxis.ops.fp8.recipe.BLOCK: activation tiles 1 x 128, weight blocks 128 x 128


def _err(field: str, value, valid: str) -> ValueError:
    return ValueError(f"MoEConfig.{field}={value!r} is invalid: {valid}.")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Hyperparameters of one MoE feed-forward block.

    Shapes use these letters: T tokens, M = d_model, H = d_ff, E = num_experts, k = top_k.

    Fields:
      d_model: M, the model width.
      d_ff: H, each expert's hidden width.
      num_experts: E.
      top_k: k experts per token.
      score_func: the router's score function, a row of the router-math table below (with
        pre_softmax): the math of each, its aliases (Mixtral's "top-k, then softmax" is
        'softmax_topk') and the models that use it.
      pre_softmax: with 'softmax': top-k of the softmax over all E experts (True) or of the
        logits, then softmax over the k selected (False); an alias sets it.
      norm_topk: renormalise the k selected weights to sum to 1.
      num_expert_groups: group-limited routing: experts split into this many equal groups
        (DeepSeek-V3's n_group; not Praxis's token `num_groups`). 1 = off.
      group_topk: keep the best `group_topk` expert groups per token; a group's score is the
        sum of its top `top_k // group_topk` selection scores.
      use_expert_bias: a learned-outside-the-gradient [E] bias added to the scores for
        selection only; the weights come from the unbiased scores (DeepSeek-V3 aux-free).
      routed_scaling_factor: multiplies the final routing weights.
      router_precision: the router GEMM `x @ router` (logits are float32 in every case):
        'auto' ('bf16x3' on a GPU, 'float32' elsewhere: the CPU computes exactly 'float32'),
        'float32' (float32 inputs and arithmetic, Precision.HIGHEST: CUDA cores on a GPU),
        'bf16x3' (each float32 input split into two bf16 parts, three bf16 tensor-core GEMMs
        with float32 accumulation, forward and backward: float32-level logits, relative error
        near 1e-5), 'tf32' (inputs rounded to TF32, float32 accumulation; TF32 tensor cores on
        a GPU), 'bf16' (inputs cast to bf16, float32 accumulation; bf16 tensor cores). Lower
        precisions change some top-k choices (tests/test_routing.py bounds the share) for a
        faster GEMM.
      router_logit_cap: soft cap `cap * tanh(logits / cap)` on the router logits (Praxis's
        `gating_logit_cap`); 0 = off.
      aux_loss_type: 'switch' (global-batch load balance), 'sequence' (the same per sequence,
        averaged; x must be [..., S, M]), 'gshard' (Praxis GShard's top-1 density loss).
      aux_loss_coeff: coefficient of the load-balancing loss (applied inside `aux_loss`).
      z_loss_coeff: coefficient of the router z-loss `mean(logsumexp(logits)^2)`.
      capacity_factor: None = dropless. Otherwise each expert takes at most
        `capacity = ceil(capacity_factor * T * k / E)` token copies; the rest are dropped
        (counted in `dropped_tokens`) by `drop_policy`.
      drop_policy: with a capacity, which copies an expert keeps: 'position' keeps all first
        choices before any second choice, each in token order (GShard); 'weight' keeps the
        copies with the largest routing weight.
      activation: 'silu' | 'gelu' | 'relu'.
      gated: gated expert `act(x @ wi_gate) * (x @ wi_up) @ wo` (SwiGLU with silu); else
        `act(x @ wi_up) @ wo`.
      fuse_gate_up: gated only. One parameter `wi_gate_up` [E, M, 2H] (gate and up columns
        interleaved: column 2j is gate unit j, 2j + 1 up unit j) instead of wi_gate and wi_up,
        and one grouped GEMM for both projections (ops.gate_up_swiglu); on the 'cuda' backend
        the SwiGLU and the routing weight run in that GEMM's epilogue. Same function as the
        unfused block with `interleave_gate_up(wi_gate, wi_up)`.
      fuse_swiglu_bwd: gated only, not with fp8. The SwiGLU backward in the epilogue of the
        down projection's dgrad grouped GEMM (ops.swiglu_down, ops.gate_up_swiglu_down:
        kernels/grouped_gemm_dswiglu.cu, writing d gate, d up, the routing weights' gradient
        and the activation the down projection's wgrad reads, so the forward keeps gate and up
        but not the activation). Runs where kernel_backend resolves to cuda with the Hopper
        grouped GEMM (bf16, d_ff % 8 == 0, silu); elsewhere the same function unfused. Off:
        measured 3-8% slower than the unfused backward on the H200 (docs/grouped_gemm.md).
      regather_rows: not with fp8, nor with fuse_gate_up and fuse_swiglu_bwd together. The
        backward of the gate and up projections permutes x again for their weight gradients
        (ops.regathered_gemms; with fuse_gate_up ops.gate_up_swiglu_regathered) instead of
        keeping the expert-sorted rows [T*k, M] from the forward, and runs their dgrads one at
        a time, so the backward holds one [T*k, M] array at a time: less activation memory for
        one more permute. On a block with expert parallelism (ep > 1) the rows are the
        exchange's output, kept as without it (the plan says so, with a warning once).
      gather_combine: the combine as one gather-and-sum over each token's k rows with the
        routing weights (ops.combine: kernels/combine.cu on 'cuda'; its backward writes the
        rows' gradient and the weights' gradient [T, k] directly) instead of the routing weight
        in the SwiGLU and an unpermute (False, today's path). Single-EP-rank blocks only (with
        ep > 1 the exchange's combine is used); it keeps the down projection's output for the
        weights' gradient (one more [T*k, M] activation).
      kernel_backend: 'auto' (CUDA kernels where built and supported, else XLA), 'xla', 'cuda'.
      use_cudnn_fusion: ask for cuDNN's fused grouped GEMM + SwiGLU (needs SM100+ and the
        optional cudnn.jax). Not implemented yet, and it has run on no hardware: where it is not
        usable (always, in this version) the block warns once (RuntimeWarning), naming the
        reason and the fallback, and runs the fallback; MOE_PRAXIS_STRICT_CUDNN_FUSION=1 makes
        that an error.
      param_init_scale: std of the normal initialisation is `scale / sqrt(fan_in)`.
      ep_exchange: expert-parallel token exchange (docs/parallelism.md): 'auto' (padded on CPU
        and on GPU meshes with ep <= 8, ragged on TPU and larger GPU meshes), 'ragged' (jax.lax.ragged_all_to_all; XLA:CPU cannot
        compile it), 'padded' (fixed-size all_to_all, runs everywhere).
      ep_buffer_factor: None = worst-case receive buffers (dropless stays dropless under EP).
        A float f > 0 bounds them to f x the balanced load; copies past the bound are
        dropped, counted in `dropped_tokens`, never written out of bounds.
      num_shared_experts: shared experts every token goes through besides its routed ones
        (DeepSeek-V2/V3, Qwen2-MoE): one dense FFN of hidden width `shared_d_ff`, added to the
        routed output of every non-padded token. 0 = none.
      shared_d_ff: Hs, the shared branch's hidden width; None = num_shared_experts * d_ff. It
        follows `gated` and `activation` (never `fuse_gate_up`); tp shards Hs, fsdp d_model.
      shared_expert_gate: scale the shared output by `sigmoid(x @ shared_gate)` per token
        (Qwen2-MoE's gate); needs num_shared_experts > 0.
      expert_bias_update_rate: u of DeepSeek-V3's auxiliary-loss-free balancing, applied once
        per optimizer step by `moe_praxis.update_expert_bias`: `b <- b + u * sign(mean_load -
        load)` on the step's global tokens_per_expert. 0 = the bias is never updated; > 0
        needs use_expert_bias.
      fp8: None (the expert GEMMs in the input dtype) or 'blockwise': DeepSeek-V3's FP8 recipe
        for the expert GEMMs (forward, dgrad and wgrad): e4m3 operands with float32 scales per
        1 x 128 activation tile and 128 x 128 weight block, float32 accumulation, outputs in
        the input dtype (moe_praxis.ops.fp8). Needs d_model and d_ff multiples of 128; not with
        fuse_gate_up. Where kernel_backend resolves to cuda on compute capability 9.0 the
        three GEMMs run the FP8 grouped GEMM kernels (moe_praxis.ops.fp8.gemm: CUTLASS sm_90a,
        blockwise scaling, bf16 GEMM outputs; the dispatch permute and the SwiGLU write the
        GEMMs' FP8 operands in their own passes, docs/kernels.md); elsewhere the pure-JAX
        emulation of that arithmetic runs (slower than bf16, and says so once). The router,
        the aux loss, the shared experts and the combine stay in higher precision. Measured on
        one H200 (docs/performance.md): with few large experts a training step is faster than
        in bf16 (Mixtral-like fwd+bwd 1.23-1.29x), with many small ones slower (Qwen3-like
        0.86x, DeepSeek-V3-like 0.81x: every expert weight is quantized every step, and the
        FP8 GEMMs get few rows per expert). moe_praxis.quantize_expert_weights(params, config)
        makes the weights' FP8 form once per optimizer step for every call of that step to
        reuse (bitwise the same results; experiments' train step does so for MoEFeedForward).
      fp8_quantize_before_gather: with fp8 and fsdp-sharded expert weights, each device
        quantizes its own shard and the all-gather moves e4m3 data and float32 scales (True,
        about half the bytes of bf16; bitwise the same result); False gathers the weights in
        their dtype and quantizes after (for comparison). A shard split along d_model or d_ff
        must hold whole 128-blocks (else a named error at trace time). Where fp8_gemms runs
        some expert GEMMs in bf16, the weights are gathered in their dtype for them (and an FP8
        form made beforehand in e4m3).
      fp8_gemms: with fp8, which expert GEMMs run in FP8: 'auto' (the measured per-GEMM rule
        moe_praxis.ops.fp8.rule.fp8_gemm_rule, the table below: each weight's forward, dgrad
        and wgrad in FP8 only at the shapes where FP8 was measured faster on an H200, the
        others in bf16 on the master weight; and a call whose weights' FP8 form would serve
        fewer than 2048 rows per expert per quantization runs the bf16 layer, its form costing
        more than FP8 saves: ops.fp8.rule.form_pays), 'all' (every expert GEMM in FP8, at
        any rows) or the GEMMs named and joined by '+' ('fwd', 'fwd+dgrad', ...: those GEMMs
        of every expert weight in FP8 at any rows, the others in bf16 on the master weight,
        as TransformerEngine's override_linear_precision; for quality runs that change one
        GEMM at a time), or per weight WEIGHT=GEMMS joined by ',' ('wi=fwd,wo=none': the gate
        and up projections' forwards in FP8; 'wo=fwd': only the down projection's; WEIGHT
        wi_gate, wi_up, wo or 'wi' for both, GEMMS as above, 'all' or 'none'; weights not
        named run bf16; on the Mixtral-like preset at 300 steps 'wo=fwd' alone trails bf16
        as far as every GEMM in FP8 does, at two seeds; at 500 steps
        'wi=all,wo=dgrad+wgrad' is 2-3 points nearer bf16 than 'all' at both seeds but
        still 3.4% behind at one, docs/performance.md). backend_info(config) and the layer's
        summaries name the choice.
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    score_func: str = "softmax"
    pre_softmax: bool = True
    norm_topk: bool = True
    num_expert_groups: int = 1
    group_topk: int = 1
    use_expert_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_precision: str = "auto"
    router_logit_cap: float = 0.0
    aux_loss_type: str = "switch"
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    drop_policy: str = "position"
    activation: str = "silu"
    gated: bool = True
    fuse_gate_up: bool = False
    fuse_swiglu_bwd: bool = False
    regather_rows: bool = False
    gather_combine: bool = False
    kernel_backend: str = "auto"
    use_cudnn_fusion: bool = False
    param_init_scale: float = 1.0
    ep_exchange: str = "auto"
    ep_buffer_factor: Optional[float] = None
    num_shared_experts: int = 0
    shared_d_ff: Optional[int] = None
    shared_expert_gate: bool = False
    expert_bias_update_rate: float = 0.0
    fp8: Optional[str] = None
    fp8_quantize_before_gather: bool = True
    fp8_gemms: str = "auto"

    def __post_init__(self):
        for name in ("d_model", "d_ff", "num_experts", "top_k", "num_expert_groups", "group_topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _err(name, v, "must be a positive int")
        if self.top_k > self.num_experts:
            raise _err("top_k", self.top_k, f"must be <= num_experts={self.num_experts}")
        bad = routing_table.invalid(self.score_func, self.pre_softmax)
        if bad:
            raise _err(bad[0], getattr(self, bad[0]), bad[1])
        sf, pre = routing_table.canonical(self.score_func, self.pre_softmax)
        object.__setattr__(self, "score_func", sf)  # an alias becomes its row's fields
        object.__setattr__(self, "pre_softmax", pre)
        if self.num_experts % self.num_expert_groups:
            raise _err(
                "num_expert_groups",
                self.num_expert_groups,
                f"must divide num_experts={self.num_experts}",
            )
        if self.group_topk > self.num_expert_groups:
            raise _err(
                "group_topk",
                self.group_topk,
                f"must be <= num_expert_groups={self.num_expert_groups}",
            )
        if self.num_expert_groups > 1:
            per_group = self.num_experts // self.num_expert_groups
            if self.top_k % self.group_topk:
                raise _err("group_topk", self.group_topk, f"must divide top_k={self.top_k}")
            if self.top_k // self.group_topk > per_group:
                raise _err(
                    "group_topk",
                    self.group_topk,
                    f"top_k // group_topk = {self.top_k // self.group_topk} exceeds the "
                    f"{per_group} experts of a group",
                )
            if self.group_topk * per_group < self.top_k:
                raise _err(
                    "group_topk",
                    self.group_topk,
                    f"{self.group_topk} groups of {per_group} experts cannot hold top_k={self.top_k}",
                )
        elif self.group_topk != 1:
            raise _err("group_topk", self.group_topk, "needs num_expert_groups > 1")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise _err("routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        if self.router_precision not in ROUTER_PRECISIONS:
            raise _err("router_precision", self.router_precision, f"valid: {ROUTER_PRECISIONS}")
        if self.router_logit_cap < 0:
            raise _err("router_logit_cap", self.router_logit_cap, "must be >= 0 (0 = off)")
        if self.aux_loss_type not in AUX_LOSS_TYPES:
            raise _err("aux_loss_type", self.aux_loss_type, f"valid: {AUX_LOSS_TYPES}")
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            v = getattr(self, name)
            if not v >= 0:
                raise _err(name, v, "must be >= 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise _err("capacity_factor", self.capacity_factor, "must be > 0, or None (dropless)")
        if self.drop_policy not in DROP_POLICIES:
            raise _err("drop_policy", self.drop_policy, f"valid: {DROP_POLICIES}")
        if self.activation not in ACTIVATIONS:
            raise _err("activation", self.activation, f"valid: {ACTIVATIONS}")
        if self.fuse_gate_up and not self.gated:
            raise _err("fuse_gate_up", self.fuse_gate_up,
                       "needs gated=True (there is no gate projection to fuse)")
        if self.fuse_swiglu_bwd and (not self.gated or self.fp8 is not None):
            raise _err("fuse_swiglu_bwd", self.fuse_swiglu_bwd,
                       "needs gated=True and fp8=None (it fuses the bf16 SwiGLU backward)")
        if self.regather_rows and (self.fp8 is not None or
                                   (self.fuse_gate_up and self.fuse_swiglu_bwd)):
            raise _err(
                "regather_rows", self.regather_rows,
                "needs fp8=None and not both fuse_gate_up and fuse_swiglu_bwd (it "
                "regathers the rows of the bf16 gate and up projections, separate or "
                "fused, not of the op that fuses them with the down projection)")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise _err("kernel_backend", self.kernel_backend, f"valid: {KERNEL_BACKENDS}")
        if self.fp8 not in FP8_RECIPES:
            raise _err("fp8", self.fp8, f"valid: {FP8_RECIPES}")
        if self.fp8 is not None:
            if self.d_model % FP8_BLOCK or self.d_ff % FP8_BLOCK:
                raise _err(
                    "fp8", self.fp8, f"needs d_model and d_ff multiples of {FP8_BLOCK} (whole "
                    f"{FP8_BLOCK}x{FP8_BLOCK} weight blocks); got d_model={self.d_model}, "
                    f"d_ff={self.d_ff}")
            if self.fuse_gate_up:
                raise _err("fp8", self.fp8, "is not implemented with fuse_gate_up=True yet")
        elif not self.fp8_quantize_before_gather:
            raise _err("fp8_quantize_before_gather", self.fp8_quantize_before_gather,
                       "only applies with fp8='blockwise' (leave it True)")
        try:
            fp8_rule.parse(self.fp8_gemms)
        except ValueError:
            raise _err("fp8_gemms", self.fp8_gemms, f"valid: {fp8_rule.VALID}") from None
        extra = fp8_rule.missing_weights(self.fp8_gemms, self.gated)
        if extra:
            raise _err(
                "fp8_gemms", self.fp8_gemms, f"it names {extra}, which an FFN with "
                f"gated={self.gated} has not (its weights: "
                f"{fp8_rule.weight_names(self.gated)})")
        if not self.param_init_scale > 0:
            raise _err("param_init_scale", self.param_init_scale, "must be > 0")
        if self.ep_exchange not in EP_EXCHANGES:
            raise _err("ep_exchange", self.ep_exchange, f"valid: {EP_EXCHANGES}")
        if self.ep_buffer_factor is not None and not (math.isfinite(self.ep_buffer_factor)
                                                      and self.ep_buffer_factor > 0):
            raise _err("ep_buffer_factor", self.ep_buffer_factor,
                       "must be a finite float > 0, or None (worst-case buffers)")
        self._check_shared_and_bias()

    def _check_shared_and_bias(self):
        n = self.num_shared_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise _err("num_shared_experts", n, "must be an int >= 0 (0 = no shared experts)")
        hs = self.shared_d_ff
        if hs is not None and (not isinstance(hs, int) or isinstance(hs, bool) or hs < 1):
            raise _err("shared_d_ff", hs, "must be a positive int, or None (num_shared_experts "
                       "* d_ff)")
        if n == 0 and hs is not None:
            raise _err(
                "shared_d_ff", hs, "needs num_shared_experts > 0 (there is no shared "
                "branch to size); set num_shared_experts or leave shared_d_ff None")
        if self.shared_expert_gate and n == 0:
            raise _err("shared_expert_gate", True, "needs num_shared_experts > 0 (there is no "
                       "shared output to gate)")
        u = self.expert_bias_update_rate
        if not (isinstance(u, (int, float)) and math.isfinite(u) and u >= 0):
            raise _err("expert_bias_update_rate", u, "must be a finite float >= 0 (0 = off)")
        if u > 0 and not self.use_expert_bias:
            raise _err("expert_bias_update_rate", u, "needs use_expert_bias=True (there is no "
                       "expert_bias to update)")

    def fp8_choices(self) -> dict:
        """{expert weight: ops.fp8.rule.Fp8Gemms} under fp8_gemms ({} without fp8)."""
        if self.fp8 is None:
            return {}
        return fp8_rule.choose_all(self.fp8_gemms, self.d_model, self.d_ff, self.gated)

    @property
    def shared_hidden(self) -> int:
        """Hs, the shared branch's hidden width (0 without shared experts)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_d_ff if self.shared_d_ff is not None else (self.num_shared_experts *
                                                                      self.d_ff)

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity for `num_tokens` tokens; only with a capacity_factor."""
        if self.capacity_factor is None:
            raise ValueError("capacity() needs capacity_factor; this config is dropless")
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))


def field_docs() -> dict[str, str]:
    """{field: description} parsed from MoEConfig's docstring (the one place fields are described)."""
    doc = MoEConfig.__doc__.split("Fields:", 1)[1]
    out: dict[str, str] = {}
    name = None
    for line in doc.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        head, sep, rest = stripped.partition(":")
        if sep and line.startswith(
                "      ") and not line.startswith("        ") and head.isidentifier():
            name = head
            out[name] = rest.strip()
        elif name:
            out[name] += " " + stripped
    return out


def markdown_table() -> str:
    """The field table of docs/config.md, generated from the dataclass (tests keep it in step)."""
    docs = field_docs()
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(MoEConfig):
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        rows.append(f"| `{f.name}` | `{default}` | {docs.get(f.name, '')} |")
    return "\n".join(rows) + "\n"


def generated_sections() -> dict[str, str]:
    """{name: text} of docs/config.md's generated parts, each between `<!-- BEGIN GENERATED
    name -->` and `<!-- END GENERATED name -->`: the field table, the router-math table and
    the FP8 GEMM rule's table."""
    return {
        "TABLE": markdown_table(),
        "ROUTER TABLE": routing_table.markdown_table(),
        "FP8 GEMM TABLE": fp8_rule.markdown_table(),
    }


def render_docs(text: str) -> str:
    """docs/config.md's text with its generated parts made anew (tests compare it to the page)."""
    for name, body in generated_sections().items():
        begin, end = f"<!-- BEGIN GENERATED {name} -->\n", f"<!-- END GENERATED {name} -->"
        if begin not in text or end not in text.split(begin, 1)[1]:
            raise ValueError(f"docs/config.md lacks the markers {begin.strip()} ... {end}")
        head, rest = text.split(begin, 1)
        text = head + begin + body + end + rest.split(end, 1)[1]
    return text


if __name__ == "__main__":  # python -m moe_praxis.config [--write]
    import argparse
    import pathlib

    parser = argparse.ArgumentParser(prog="python -m moe_praxis.config",
                                     description="Print the MoEConfig field table, or (--write) "
                                     "regenerate docs/config.md's generated tables.")
    parser.add_argument("--write", action="store_true", help="rewrite docs/config.md in place")
    if parser.parse_args().write:
        page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "config.md"
        page.write_text(render_docs(page.read_text()))
        print(f"wrote {page}")
    else:
        print(markdown_table(), end="")
