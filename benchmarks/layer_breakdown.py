"""Per-stage GPU time of one jitted step, from a JAX profiler trace (`--breakdown`).

The step runs `reps` times, pipelined, under jax.profiler.trace (benchmarks/trace.py); every kernel and
memset on the GPU streams is attributed to the HLO instruction it ran for, then to a stage:

  1. the event's `hlo_op` argument (the profiler's stat), else the kernel's name read as an
     XLA kernel name (an instruction's name with '.' and '-' as '_'), else the "XLA Ops" event
     on the GPU that contains the kernel in time;
  2. that instruction, looked up in the compiled HLO text (`compiled.as_text()`): its custom-call
     target and its op_name metadata (JAX's name stack, holding moe_block's named scopes
     moe_router, moe_dispatch and moe_experts, backward ops included: transpose(jvp(...)));
  3. STAGES below, first match wins; a kernel with no instruction is matched on its own name
     (KERNEL_NAMES).

The stage table (what each regex is matched against: `target` = custom-call target, `gemm` = an
instruction (a dot, a cuBLAS call, a GEMM fusion) whose op_name ends in a matrix product
(dot_general, ragged_dot, ...) and matches, `scope` =
op_name):
"""

from __future__ import annotations

import collections
import re
import tempfile

from benchmarks import trace

STAGES = [  # (stage, kind, regex)
    ("grouped GEMM fwd", "target", r"^moe_grouped_gemm_fwd$"),
    ("grouped GEMM dgrad", "target", r"^moe_grouped_gemm_dgrad$"),
    ("grouped GEMM wgrad", "target", r"^moe_grouped_gemm_wgrad$"),
    ("gate/up GEMM + SwiGLU fwd (fused)", "target", r"^moe_grouped_gemm_swiglu_fwd$"),
    ("FP8 grouped GEMM fwd / dgrad (nt)", "target", r"^moe_grouped_gemm_fp8_nt$"),
    ("FP8 grouped GEMM wgrad", "target", r"^moe_grouped_gemm_fp8_wgrad"),
    ("FP8 quantize weights (L2)", "target", r"^moe_fp8_quantize_weight$"),
    ("FP8 quantize rows (L1)", "target", r"^moe_fp8_quantize_rows$"),
    ("FP8 quantize grouped rows (L3, wgrad)", "target", r"^moe_fp8_quantize_rows_grouped_t$"),
    ("SwiGLU + FP8 (L1)", "target", r"^moe_swiglu_fwd_fp8$"),
    ("permute + FP8 (L1)", "target", r"^moe_permute_fp8$"),
    ("routing kernel", "target", r"^moe_router_"),
    ("aux loss", "target", r"^moe_aux_loss_"),
    ("SwiGLU", "target", r"^moe_swiglu_"),
    ("permute", "target", r"^moe_permute(_index|_indexed)?$"),
    ("sort kernel", "target", r"^moe_expert_sort$"),
    ("unpermute / combine", "target",
     r"^moe_(unpermute|unpermute_indexed|combine_fwd|combine_bwd)$"),
    ("router GEMM", "gemm", r"moe_router"),
    ("expert GEMMs (XLA)", "gemm", r"moe_experts"),
    ("aux loss", "scope", r"aux_loss"),
    ("routing + statistics (XLA ops)", "scope", r"moe_router"),
    ("sort / capacity (XLA ops)", "scope", r"moe_dispatch"),
    ("experts: other XLA ops (casts, the dgrad add, gathers)", "scope", r"moe_experts"),
]
OTHER = "everything else"
# Kernels without an HLO instruction, by their own name (kernels/*.cu, CUTLASS).
KERNEL_NAMES = [
    ("routing kernel", r"router_(fwd|bwd)"),
    ("aux loss", r"aux_loss"),
    ("SwiGLU", r"swiglu"),
    ("unpermute / combine", r"unpermute|combine_(fwd|dout|dw)_kernel"),
    ("sort kernel", r"chunk_histogram_kernel|offsets_kernel|scatter_kernel"),
    ("permute", r"permute|histogram_kernel|sort_lists_kernel|scan_kernel"),
    ("grouped GEMM (op not known)", r"cutlass|moe_gg_prepare"),
    ("dense GEMM (cuBLAS, op not known)", r"gemm|xmma|nvjet|cublas"),
]
__doc__ += "\n".join(f"  {stage:55s} {kind:6s} {rx}" for stage, kind, rx in STAGES)
__doc__ += f"\n  {OTHER}\nKernels with no instruction, by name:\n" + "\n".join(
    f"  {stage:55s} {rx}" for stage, rx in KERNEL_NAMES) + "\n"

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_GEMM_OPS = ("dot_general", "dot", "ragged_dot", "ragged_dot_general", "matmul")


def _norm(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def hlo_index(hlo_text: str) -> dict[str, dict]:
    """Instruction name (normalised: '.' and '-' as '_') -> {target, op_name, gemm} for every
    instruction of the compiled HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group(2)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        op_name = re.search(r'op_name="([^"]+)"', rest)
        op_name = op_name.group(1) if op_name else ""
        out[_norm(m.group(1))] = dict(target=target.group(1) if target else "",
                                      op_name=op_name,
                                      gemm=op_name.rsplit("/", 1)[-1] in _GEMM_OPS)
    return out


def stage_of(info: dict | None, kernel: str) -> str:
    """The stage of one kernel: by its HLO instruction's info (hlo_index), else its name."""
    if info is not None:
        for stage, kind, rx in STAGES:
            if kind == "target" and re.search(rx, info["target"]):
                return stage
            if kind == "gemm" and info["gemm"] and re.search(rx, info["op_name"]):
                return stage
            if kind == "scope" and re.search(rx, info["op_name"]):
                return stage
        if info["target"] or info["op_name"]:
            return OTHER
    for stage, rx in KERNEL_NAMES:
        if re.search(rx, kernel):
            return stage
    return OTHER


def _instruction(event: dict, index: dict, ops: list[dict]) -> tuple[dict | None, str]:
    """(info, how) of the instruction a kernel event ran for (module docstring, step 1)."""
    for key in ("hlo_op", "long_name", "tf_op"):
        v = str(event["args"].get(key, "")).split(" ")[0].lstrip("%")
        if _norm(v) in index:
            return index[_norm(v)], "hlo_op"
    if _norm(event["name"]) in index:
        return index[_norm(event["name"])], "kernel name"
    mid = event["ts"] + event["dur"] / 2
    for op in ops:  # ops sorted by start
        if op["ts"] > mid:
            break
        name = _norm(op["name"].lstrip("%"))
        if op["ts"] + op["dur"] >= mid and name in index:
            return index[name], "XLA Ops line"
    return None, "none"


def breakdown(fn, args, hlo_text: str, *, reps: int = 5, classify=stage_of) -> dict:
    """Per-stage GPU time of fn(*args) (a compiled step; hlo_text: its compiled HLO): {stages: {stage: {ms, kernels}},
    gpu_ms (per step), attributed (how many events by each route), top_other: the largest
    kernels left in OTHER, top_kernels: {stage: the 3 largest kernels (name, ms per step)}}.
    classify(info, kernel name) -> stage (default stage_of: the MoE layer's stages; the
    end-to-end step's parts: benchmarks.e2e_parts.part_of). Raises trace.NoGpuEvents (with
    the reason) where the trace has no GPU kernels, e.g. on the CPU."""
    index = hlo_index(hlo_text)
    with tempfile.TemporaryDirectory(prefix="layer_trace_") as tmp:
        trace.traced(fn, args, reps, tmp, pipelined=True)
        events = trace.gpu_stream_events(tmp)
        try:
            ops = sorted(trace.gpu_stream_events(tmp, "XLA Ops"), key=lambda e: e["ts"])
        except trace.NoGpuEvents:
            ops = []
    stages = collections.defaultdict(lambda: dict(ms=0.0, kernels=0.0))
    how = collections.Counter()
    by_kernel = collections.defaultdict(collections.Counter)
    for e in events:
        info, route = _instruction(e, index, ops)
        how[route] += 1
        stage = e["stage"] = classify(info, e["name"])
        stages[stage]["ms"] += e["dur"] / 1e3 / reps
        stages[stage]["kernels"] += 1 / reps
        by_kernel[stage][e["name"][:80]] += e["dur"] / 1e3 / reps
    return dict(stages=dict(stages),
                gpu_ms=sum(s["ms"] for s in stages.values()),
                attributed=dict(how),
                top_other=by_kernel[OTHER].most_common(5),
                top_kernels={
                    k: c.most_common(3)
                    for k, c in by_kernel.items()
                },
                idle=idle_gaps(events, reps))


def idle_gaps(events: list[dict], reps: int, *, top: int = 8) -> dict:
    """Where the GPU waits inside a step: the gaps between the merged busy intervals of the
    kernel events (each with its "stage"), less the reps - 1 largest (between the traced
    steps). Per step: idle_ms, gaps (how many over 5 us), by_next_stage ({stage of the kernel
    after the gap: ms}); largest: the `top` largest gaps as (us, stage before, stage after,
    kernel after); between_steps_ms: the mean of the gaps left out (the steps traced pipelined,
    as breakdown() runs them: where the GPU waits for the host's next call)."""
    ev = sorted(events, key=lambda e: e["ts"])
    gaps, end, last = [], None, None
    for e in ev:
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, last, e))
        if end is None or e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    gaps.sort(key=lambda g: -g[0])
    between = gaps[:max(reps - 1, 0)]
    inner = gaps[max(reps - 1, 0):]
    by_next = collections.Counter()
    for us, _, after in inner:
        by_next[after.get("stage", OTHER)] += us / 1e3 / reps
    return dict(idle_ms=sum(g[0] for g in inner) / 1e3 / reps,
                between_steps_ms=sum(g[0] for g in between) / 1e3 / max(len(between), 1),
                gaps=sum(g[0] > 5 for g in inner) / reps,
                by_next_stage={
                    k: round(v, 4)
                    for k, v in by_next.most_common()
                },
                largest=[(round(us, 1), b.get("stage", OTHER), a.get("stage",
                                                                     OTHER), a["name"][:60])
                         for us, b, a in inner[:top]])


def table(name: str, result: dict, step_ms: float | None, order=None) -> str:
    """Markdown: one row per stage (ms per step, share of the GPU time, kernels per step), in
    ``order`` (default: this module's stages)."""
    gpu = result["gpu_ms"]
    busy = f", GPU busy {100 * gpu / step_ms:.0f}% of the {step_ms:.3f} ms step" if step_ms else ""
    lines = [
        f"{name}: {gpu:.3f} ms of GPU kernels per step{busy}",
        "| stage | ms | % of GPU time | kernels |", "|---|---|---|---|"
    ]
    if order is None:
        order = [s for s, _, _ in STAGES] + [s for s, _ in KERNEL_NAMES] + [OTHER]
    for stage in dict.fromkeys(order):
        if stage in result["stages"]:
            s = result["stages"][stage]
            lines.append(f"| {stage} | {s['ms']:.3f} | {100 * s['ms'] / max(gpu, 1e-12):.1f} | "
                         f"{s['kernels']:.0f} |")
    lines.append(f"attributed by: {result['attributed']}; largest in '{OTHER}': "
                 f"{[(n, round(ms, 3)) for n, ms in result['top_other']]}")
    idle = result.get("idle")
    if idle:
        lines.append(f"GPU idle between pipelined steps: {idle['between_steps_ms']:.3f} ms; "
                     f"inside a step: {idle['idle_ms']:.3f} ms in {idle['gaps']:.0f} "
                     f"gaps over 5 us; before (ms): {idle['by_next_stage']}; largest (us, "
                     f"stage before, stage after, kernel after): {idle['largest']}")
    return "\n".join(lines)
