"""The parts of one training step, for ``python -m benchmarks.e2e --breakdown``: each GPU kernel
of the step's profiler trace is matched to its HLO instruction (benchmarks/layer_breakdown.py),
and the instruction to a part by its custom-call target and its op_name (JAX's name stack:
``jit(train_fn)/jvp(lm.apply)/lm/transformer/x_layers_0/self_attention/...`` in the forward,
``transpose(jvp(lm.apply))/...`` in the backward; Flax writes the module path into it).

PARTS below, first match wins (``target``: the custom-call target; ``last``: the op_name's
last component, the primitive; ``scope``: the whole op_name); a kernel with no instruction is
matched on its own name (KERNEL_NAMES). Casts are counted as their own part wherever they sit
(the fprop-dtype copies of weights, activations cast for the loss), except inside the MoE
layer's custom calls and cuDNN's attention. The optimizer is what the step runs outside the
model's apply (the AdamW update, the gradient norm and clip, the metrics; copies named after a
state leaf, ``state['opt_state']...``).
"""

from __future__ import annotations

import re

from benchmarks import layer_breakdown

OTHER = layer_breakdown.OTHER
PARTS = [  # (part, kind, regex)
    ("MoE layers", "target", r"^moe_"),
    ("attention", "target", r"cudnn\$fmha|fused_attention|flash"),
    ("casts", "last", r"^convert_element_type$"),
    ("MoE layers", "scope", r"\._moe/|/moe_(router|dispatch|experts|combine)|/moe/"),
    ("attention", "scope", r"/self_attention/"),
    ("norms", "scope", r"/(layer_norm|final_ln|ln)(/|$)"),
    ("dense FFN", "scope", r"/ff_layer/(ffn_layer\d|activation)"),
    ("MoE layers", "scope", r"/ff_layer/"),  # the rest of an MoE layer (its residual add)
    ("embedding + softmax + loss", "scope", r"lm\.compute_loss|/softmax/|emb_lookup|/lm/[^/]+$"),
    ("optimizer", "optimizer", r"^jit\(train_fn\)|^state\["),
]
KERNEL_NAMES = [
    ("attention", r"fmha|flash|cudnn"),
    ("MoE layers", r"cutlass|moe_|router_|swiglu|permute|combine_"),
]
ORDER = list(dict.fromkeys([p for p, _, _ in PARTS] + [OTHER]))
__doc__ += "\n".join(f"  {part:28s} {kind:9s} {rx}" for part, kind, rx in PARTS)
__doc__ += ("\n  (optimizer: an op_name under jit(train_fn) and not under the model's apply)\n"
            f"  {OTHER}\nKernels with no instruction, by name:\n" +
            "\n".join(f"  {part:28s} {rx}" for part, rx in KERNEL_NAMES) + "\n")


def part_of(info: dict | None, kernel: str) -> str:
    """The part of one kernel: by its HLO instruction's info ({target, op_name}, as
    layer_breakdown.hlo_index makes it), else by the kernel's name."""
    if info is not None:
        op_name = info.get("op_name", "")
        for part, kind, rx in PARTS:
            if kind == "target" and re.search(rx, info.get("target", "")):
                return part
            if kind == "last" and op_name and re.search(rx, op_name.rsplit("/", 1)[-1]):
                return part
            if kind == "scope" and re.search(rx, op_name):
                return part
            if kind == "optimizer" and re.search(rx, op_name) and "lm.apply" not in op_name:
                return part
        if info.get("target") or op_name:
            return OTHER
    for part, rx in KERNEL_NAMES:
        if re.search(rx, kernel):
            return part
    return OTHER


def hlo_parts(hlo_text: str) -> dict[str, int]:
    """How many instructions of a compiled HLO text fall in each part (a check of the table on
    any backend: the CPU's HLO carries the same op_names)."""
    counts = dict.fromkeys(ORDER, 0)
    for info in layer_breakdown.hlo_index(hlo_text).values():
        if info["target"] or info["op_name"]:
            counts[part_of(info, "")] += 1
    return counts
