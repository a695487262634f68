"""The layer benchmark's options, derived columns, the layer's targets, table and JSON
(`python -m benchmarks.layer`; the module doc of benchmarks/layer.py describes them)."""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import layer_cases as lc
from benchmarks import layer_fp8w, layer_sweep
from moe_praxis import expert_weights
from moe_praxis.ops import dswiglu, gate_up, grouped_gemm_tiles
from moe_praxis.ops.fp8 import rule as fp8_rule

DEFAULT_JSON = "benchmarks/results/layer_bench.json"
GSHARD_REF = "gshard cf2.5"  # the GShard row 'x GShard' divides by (equal capacity per copy)
TARGET_METHODS = ("cuda", "cuda+fuse")
SKEW_SLACK = 1.15
FP8_SPEEDUP = 1.35  # the FP8 experts' target: 'cuda+fp8' fwd+bwd over 'cuda', Mixtral-like, balanced


def _list(choices, what):

    def parse(text):
        items = [s for s in text.split(",") if s]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what} {bad or text!r} invalid; valid: "
                                             f"{', '.join(choices)} (comma-separated)")
        return items

    return parse


def _ints(text):
    try:
        return [int(s) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need comma-separated ints") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layer",
                                 description="The whole MoE layer on one device.")
    ap.add_argument("--shapes",
                    type=_list(tuple(lc.SHAPES), "shape"),
                    default=list(lc.SHAPES),
                    help="comma-separated: " + ", ".join(lc.SHAPES))
    ap.add_argument("--methods",
                    type=_list(lc.METHODS, "method"),
                    default=list(lc.METHODS),
                    help="comma-separated: " + ", ".join(lc.METHODS))
    ap.add_argument("--skew",
                    action=argparse.BooleanOptionalAction,
                    default=True,
                    help="also time the skewed load (busiest expert 4x the mean)")
    ap.add_argument("--breakdown",
                    action="store_true",
                    help="per-stage GPU time of the fwd+bwd step from a profiler trace")
    ap.add_argument("--json", default=DEFAULT_JSON, help="where the JSON goes")
    ap.add_argument("--quick",
                    action="store_true",
                    help="CPU sizes, 2 rounds, kernel_backend xla: the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="interleaved rounds (7; 2 --quick)")
    ap.add_argument("--gshard-groups",
                    type=_ints,
                    default=None,
                    help="GShard num_groups swept at Mixtral (8,32,128; 1,4 --quick)")
    ap.add_argument("--microbatches",
                    type=_ints,
                    default=list(layer_fp8w.DEFAULT_MICROBATCHES),
                    help="micro-batches per optimizer step of the rows 'cuda+fp8 @n' (1,8)")
    ap.add_argument("--tokens",
                    type=layer_sweep.parse_tokens,
                    default=None,
                    help="token-count sweep: every shape at each T (e.g. 4096,16384,65536)")
    ap.add_argument("--time-budget",
                    type=float,
                    default=1e9,
                    help="seconds: no new shape starts past it (the JSON keeps what ran)")
    return ap


def parse_args(argv=None):
    opts = build_parser().parse_args(argv)
    if not opts.microbatches or min(opts.microbatches) < 1:
        build_parser().error(f"--microbatches {opts.microbatches}: need ints >= 1")
    opts.reps = opts.reps or (2 if opts.quick else 7)
    opts.gshard_groups = opts.gshard_groups or ([1, 4] if opts.quick else [8, 32, 128])
    opts.target_s = 0.01 if opts.quick else 0.25
    return opts


def derive(rows: list[dict], shape: lc.Shape, pass_: str, copy_bw: float) -> None:
    """Adds the roofline row and TFLOP/s, % of ideal, % of roofline, x GShard to `rows` (one
    (shape, load, pass)). Roofline = ideal + expert weight bytes (1x fwd; 2 reads + 1 gradient
    write fwd+bwd) / copy bandwidth (bytes read + written per second)."""
    by = {r["method"]: r for r in rows if r.get("ms")}
    ideal = by.get("ideal", {}).get("ms")
    roof = None
    if ideal:
        traffic = lc.expert_weight_bytes(shape) * (1 if pass_ == "fwd" else 3)
        roof = ideal + traffic / copy_bw * 1e3
        rows.append(
            dict(shape=rows[0]["shape"],
                 load=rows[0]["load"],
                 pass_=pass_,
                 method="roofline",
                 ms=roof,
                 status="computed",
                 weight_traffic_bytes=traffic))
    gshard = by.get(GSHARD_REF, {}).get("ms")
    cuda_ms = by.get("cuda", {}).get("ms")
    flops = lc.expert_flops(shape, pass_)
    for r in rows:
        if not r.get("ms"):
            continue
        r["tflops"] = flops / r["ms"] / 1e9
        r["pct_ideal"] = 100 * ideal / r["ms"] if ideal else None
        r["pct_roofline"] = 100 * roof / r["ms"] if roof else None
        r["x_gshard"] = gshard / r["ms"] if gshard else None
        r["x_cuda"] = cuda_ms / r["ms"] if cuda_ms else None


def _target(r: dict, balanced_ms: float | None):
    """(text, ok) of the layer's target for one row (the FP8 experts' for 'cuda+fp8'), or None where
    none applies."""
    if "microbatches" in r:
        return layer_fp8w.target(r)
    shape = layer_sweep.base_name(r["shape"])
    if r["method"] == "cuda+fp8":
        if r["pass_"] != "fwd+bwd" or r["load"] != "balanced" or shape != "mixtral":
            return None
        xc = r.get("x_cuda") or 0
        return f">= {FP8_SPEEDUP}x 'cuda' (x{xc:.2f})", xc >= FP8_SPEEDUP
    if r["pass_"] != "fwd+bwd" or r["method"] not in TARGET_METHODS:
        return None
    if r["load"] == "skewed":
        ok = bool(r.get("ms") and balanced_ms and r["ms"] <= SKEW_SLACK * balanced_ms)
        return f"<= {SKEW_SLACK:.2f}x balanced", ok
    pi, pr, xg = (r.get(k) or 0 for k in ("pct_ideal", "pct_roofline", "x_gshard"))
    if shape == "qwen3":
        return ">= 80% of ideal", pi >= 80
    if shape == "deepseek_ep4":  # one EP-4 rank's experts
        return ">= 90% of ideal", pi >= 90
    if shape == "deepseek":
        return ">= 75% of ideal or >= 90% of roofline", pi >= 75 or pr >= 90
    return ">= 95% of ideal and >= 1.25x GShard", pi >= 95 and xg >= 1.25


def targets(rows: list[dict]) -> list[dict]:
    """Marks each targeted row with target and verdict (PASS / FAIL); returns those rows' keys."""
    balanced = {
        (r["shape"], r["method"], r["pass_"]): r.get("ms")
        for r in rows if r["load"] == "balanced"
    }
    out = []
    for r in rows:
        t = _target(r, balanced.get((r["shape"], r["method"], r["pass_"])))
        if t is None:
            continue
        r["target"], ok = t
        r["verdict"] = "PASS" if ok else "FAIL"
        out.append({k: r.get(k) for k in ("shape", "load", "method", "target", "verdict")})
    return out


def _f(v, fmt):
    if not isinstance(v, (int, float)):
        return "-"
    return format(v, ".2g") if fmt == ".0f" and abs(v) < 10 else format(v, fmt)


def _method(r: dict) -> str:
    if "num_groups" in r:
        drop = f", drops {100 * r['dropped']:.2f}%" if r.get("dropped") is not None else ""
        return f"{r['method']} (num_groups {r['num_groups']}{drop})"
    return r["method"]


def table(rows: list[dict]) -> str:
    out = [
        "| shape | load | pass | method | ms | TFLOP/s | % of ideal | % of roofline | x GShard "
        "| x torch | peak GB | act GB | target | PASS/FAIL |", "|" + "---|" * 14
    ]
    for r in rows:
        load = r["load"]
        if r.get("skew_max_over_mean"):
            load += f" ({r['skew_max_over_mean']:.2f}x)"
        ms = _f(r.get("ms"), ".3f") if r.get("ms") else r.get("status", "-")
        peak = _f(r["peak_bytes"] / 1e9, ".1f") if r.get("peak_bytes") else "-"
        act = _f(r["temp_bytes"] / 1e9, ".2f") if r.get("temp_bytes") is not None else "-"
        out.append(f"| {r['shape']} | {load} | {r['pass_']} | {_method(r)} | {ms} | "
                   f"{_f(r.get('tflops'), '.0f')} | {_f(r.get('pct_ideal'), '.0f')} | "
                   f"{_f(r.get('pct_roofline'), '.0f')} | {_f(r.get('x_gshard'), '.2f')} | "
                   f"{_f(r.get('x_torch'), '.2f')} | "
                   f"{peak} | {act} | {r.get('target', '-')} | {r.get('verdict', '-')} |")
    return "\n".join(out)


def fp8_gemms(configs: dict, rows_per_expert=None) -> dict:
    """{method: {weight: {'fwd' | 'dgrad' | 'wgrad': 'fp8' | 'bf16'}}} of the FP8 methods'
    configs (MoEConfig.fp8_gemms, ops.fp8.rule), each printed on one line. rows_per_expert: one
    call's (T * k / E): a method that quantizes its own weights runs the bf16 layer below
    FORM_MIN_ROWS (moe_praxis.expert_weights.fp8_for_call); 'cuda+fp8w' is given the form."""
    out = {}
    for m, c in configs.items():
        choices = c.fp8_choices()
        why = ""
        if rows_per_expert is not None and m != layer_fp8w.PREQUANTIZED:
            choices = expert_weights.fp8_for_call(c, {}, rows_per_expert)[1]
            if not any(g.any for g in choices.values()):
                why = (f" (the weights' FP8 form would serve {rows_per_expert:g} rows per expert, "
                       f"under {fp8_rule.FORM_MIN_ROWS}: the bf16 layer)")
        out[m] = fp8_rule.describe(choices)
        ran = ", ".join(f"{w} {g.label()}" for w, g in choices.items())
        print(f"{m}: fp8_gemms={c.fp8_gemms!r}, FP8 GEMMs: {ran}{why}", flush=True)
    return out


def gemm_configs(shape: lc.Shape) -> dict:
    """The configurations the Hopper grouped GEMM's rule (ops.grouped_gemm_tiles.choose_config,
    or MOE_PRAXIS_GG_TILE) picks for the layer's expert GEMMs on one device at a balanced load
    (T * k rows): {'wi' (gate and up), 'wo': {op: config}, 'gate_up_fused': the fused forward's,
    'dswiglu': the fused dSwiGLU dgrad's}, each printed on one line. A run's JSON then says
    which kernels its rows timed, whatever the rule becomes later."""
    rows, m, h, e = shape.t * shape.k, shape.m, shape.h, shape.e
    out = {
        w: {
            op: grouped_gemm_tiles.choose_config(op, rows, k, n, e)
            for op in grouped_gemm_tiles.OPS
        }
        for w, (k, n) in (("wi", (m, h)), ("wo", (h, m)))
    }
    out["gate_up_fused"] = gate_up.choose_fused_config(rows, m, 2 * h, e)
    out["dswiglu"] = dswiglu.choose_config(rows, h, m, e)
    for what, c in out.items():
        print(f"grouped GEMM configurations, {what}: {c}", flush=True)
    return out


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        ms = f"{r['ms']:.3f} ms" if r.get("ms") else r.get("status", "?")
        print(f"  {r['shape']} {r['load']} {r['pass_']} {_method(r)}: {ms}", flush=True)


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
