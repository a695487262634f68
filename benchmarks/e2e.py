"""End-to-end training-step speed of a registered experiment: tokens/s, model FLOPs, MFU, peak
memory, and (``--breakdown``) the step's GPU time by part.

  python -m benchmarks.e2e --exp NAME [--steps N] [--warmup N] [--breakdown] [--json PATH]
      [--attention auto|xla|cudnn] [--remat POLICY] [--stack repeated|layers]
      [--fdl_set PATH=VALUE ...]

The step is the main job's (``experiments.train.steps.make_step_fns``: forward, backward, AdamW, on
the experiment's mesh), compiled once and run on one synthetic batch of the experiment's shape
(random token ids; with data.packing='documents', random packed segments). Each timed step
waits for its result (``jax.block_until_ready``); tokens/s = batch x seq_len / the median step
time over ``--steps`` steps after ``--warmup``.

Model FLOPs per token, as MaxText counts them (printed with the numbers):
  6 x active parameters + 12 x layers x seq_len x attention width
active parameters: every parameter of the tree, the expert weights (wi_gate, wi_up,
wi_gate_up, wo of the MoE layers) times top_k / num_experts; attention width: query heads x
head dim. TFLOP/s = FLOPs per token x tokens/s; MFU = that over the device's dense bf16 peak
(PEAK_TFLOPS; a device not in the table gets no MFU, and the output says so). Peak memory:
``device.memory_stats()['peak_bytes_in_use']`` where the backend reports it.

--attention sets every attention layer's attention_impl; --remat the stack's remat policy
(configs.models.REMAT_POLICIES); --stack the experiment's REPEAT knob (a scanned block, or
each layer with its own weights: no per-layer slice of stacked weights); --fdl_set any other config leaf (``experiments.main``'s
syntax). --breakdown: the step traced under the profiler (GPU only), each kernel attributed to
a part by benchmarks/e2e_parts.py, with the largest kernels of each part.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis  # noqa: F401  (the Praxis shims before configs import praxis)
from benchmarks import e2e_parts, layer_breakdown, trace
from configs import models, registry
from experiments.train import setup, steps
from experiments.job.overrides import apply_overrides
from moe_praxis import attention as attn
from moe_praxis.expert_weights import GATHERED

# Dense (not sparse) bf16 tensor-core peaks, TFLOP/s, by device kind; first match wins.
PEAK_TFLOPS = [
    (r"GH200", 989.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100", 989.0),  # SXM
    (r"A100", 312.0),
    (r"B200", 2250.0),
]
FORMULA = "6 x active parameters + 12 x layers x seq_len x attention width"
STACKS = ("repeated", "layers")  # --stack: the experiment's REPEAT knob True / False


def peak_tflops(device_kind: str) -> float | None:
    for rx, peak in PEAK_TFLOPS:
        if re.search(rx, device_kind):
            return peak
    return None


def model_flops(params, model_cfg, seq_len: int) -> dict:
    """FLOPs per token of one training step (FORMULA), from the parameter tree (shapes only)
    and the model config."""
    block = models.stack_block(model_cfg)
    moe = models.moe_layer_configs(model_cfg)
    experts = block.num_experts
    top_k = moe[0].num_experts_per_token if moe and experts else 0
    total = expert = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        n = math.prod(leaf.shape)
        total += n
        last = path[-1]
        if experts and getattr(last, "key", None) in GATHERED:
            expert += n
    active = total - expert + (expert * top_k / experts if experts else 0)
    head_dim = block.dim_per_head or block.model_dims // block.num_heads
    width = block.num_heads * head_dim
    layers = models.num_layers(model_cfg)
    attention = 12 * layers * seq_len * width
    return dict(formula=FORMULA,
                params=total,
                expert_params=expert,
                top_k=top_k,
                num_experts=experts,
                active_params=active,
                layers=layers,
                seq_len=seq_len,
                attention_width=width,
                attention_flops_per_token=attention,
                flops_per_token=6 * active + attention)


def synthetic_batch(data, vocab: int, rng: np.random.Generator) -> dict:
    """One batch of the experiment's shape: random ids and labels, unit weights; with
    packing='documents', rows of random pieces (segment_ids 1, 2, ..., segment_pos from 0)."""
    b, s = data.batch_size, data.seq_len
    batch = {
        "ids": rng.integers(0, vocab, (b, s)).astype(np.int32),
        "labels": rng.integers(0, vocab, (b, s)).astype(np.int32),
        "weights": np.ones((b, s), np.float32),
    }
    if data.packing == "documents":
        seg = np.zeros((b, s), np.int32)
        pos = np.zeros((b, s), np.int32)
        for r in range(b):
            cuts = np.sort(rng.choice(np.arange(1, s), size=min(7, s - 1), replace=False))
            seg[r] = np.searchsorted(cuts, np.arange(s), side="right") + 1
            starts = np.concatenate([[0], cuts])
            pos[r] = np.arange(s) - starts[seg[r] - 1]
        batch.update(segment_ids=seg, segment_pos=pos)
    return batch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--exp", help="a registered experiment (--exp of the main)")
    p.add_argument("--summary",
                   metavar="DIR",
                   help="print one table of every e2e_*.json under DIR (nothing is run)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps run before the timed ones")
    p.add_argument("--breakdown", action="store_true", help="GPU time by part (profiler)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--attention",
                   choices=attn.IMPLS,
                   default=None,
                   help="every attention layer's attention_impl (default: the experiment's)")
    p.add_argument("--remat",
                   choices=models.REMAT_POLICIES,
                   default=None,
                   help="the stack's remat policy (default: the experiment's)")
    p.add_argument("--stack",
                   choices=STACKS,
                   default=None,
                   help="the layers as one scanned block ('repeated') or each its own "
                   "('layers'); default: the experiment's REPEAT")
    p.add_argument("--fdl_set",
                   action="append",
                   default=[],
                   metavar="PATH=VALUE",
                   help="override a config leaf, as experiments.main's --fdl_set")
    return p


def parse_args(argv=None):
    p = build_parser()
    opts = p.parse_args(argv)
    if (opts.exp is None) == (opts.summary is None):
        p.error("give --exp NAME (run it) or --summary DIR (tabulate earlier runs), one of them")
    if opts.steps < 1 or opts.warmup < 0:
        p.error(f"--steps={opts.steps} must be >= 1 and --warmup={opts.warmup} >= 0")
    return opts


def stack_kind(lm) -> str:
    """'repeated' (the layers one scanned block: each step slices a layer's weights out of the
    stacked arrays) or 'layers' (each layer its own weights)."""
    return "repeated" if hasattr(lm.stacked_transformer_tpl, "x_times") else "layers"


def build(opts):
    """(Prepared, the experiment config) with the command line's changes applied."""
    exp = registry.get_experiment(opts.exp)
    if opts.stack is not None:  # the experiment with its REPEAT knob changed, same name
        exp = type(exp.__name__, (exp, ), {"REPEAT": opts.stack == "repeated"})
    cfg = exp().experiment_config()
    apply_overrides(cfg, opts.fdl_set)
    if opts.attention is not None:
        models.set_attention(cfg.model, attention_impl=opts.attention)
    if opts.remat is not None:
        models.set_remat(cfg.model, opts.remat)
    return setup.prepare(cfg, load_data=False), cfg


def run(opts) -> dict:
    t0 = time.time()
    prep, cfg = build(opts)
    dev = jax.devices()[0]
    data = prep.config.data
    fns = steps.make_step_fns(prep)
    with jax.set_mesh(prep.mesh):
        state = fns.init(jax.random.key(prep.config.train.seed))
        batch = steps.put_batch(
            synthetic_batch(data, prep.model.vocab_size, np.random.default_rng(0)),
            fns.batch_sharding)
        t1 = time.time()
        compiled = fns.train.lower(state, batch).compile()
        compile_s = time.time() - t1
        for _ in range(opts.warmup):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        times = []
        for _ in range(opts.steps):
            t1 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t1)
    step_s = statistics.median(times)
    tokens = data.batch_size * data.seq_len
    flops = model_flops(state["params"], prep.model_config, data.seq_len)
    tps = tokens / step_s
    tflops = flops["flops_per_token"] * tps / 1e12
    peak = peak_tflops(dev.device_kind)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    block = models.stack_block(prep.model_config)
    atten = models.attention_configs(prep.model_config)
    result = dict(
        meta=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=dev.device_kind,
                  platform=dev.platform,
                  devices=len(prep.mesh.devices.flat),
                  jax=jax.__version__,
                  python=platform.python_version(),
                  argv=list(sys.argv[1:])),
        exp=cfg.name,
        attention_impl=atten[0].attention_impl if atten else None,
        attention_routes=attn.routes(),
        remat=models.remat_policy(prep.model_config),
        stack=stack_kind(prep.model_config),
        stack_changed=opts.stack is not None,
        fdl_set=list(opts.fdl_set),
        shape=dict(batch=data.batch_size,
                   seq_len=data.seq_len,
                   packing=data.packing,
                   layers=flops["layers"],
                   model_dims=block.model_dims,
                   num_heads=block.num_heads,
                   num_kv_heads=atten[0].num_kv_heads if atten else None,
                   num_experts=flops["num_experts"],
                   top_k=flops["top_k"],
                   fprop_dtype=str(jnp.dtype(prep.model.fprop_dtype))),
        compile_s=compile_s,
        step_ms=step_s * 1e3,
        step_ms_all=[t * 1e3 for t in times],
        tokens_per_step=tokens,
        tokens_per_sec=tps,
        flops=flops,
        tflops_per_sec=tflops,
        peak_tflops=peak,
        mfu=tflops / peak if peak else None,
        peak_memory_bytes=(stats or {}).get("peak_bytes_in_use"),
        loss=float(metrics["loss"]),
        notes=[],
    )
    if peak is None:
        result["notes"].append(f"MFU left out: no dense bf16 peak known for device kind "
                               f"{dev.device_kind!r} (benchmarks/e2e.py PEAK_TFLOPS)")
    if result["peak_memory_bytes"] is None:
        result["notes"].append(f"peak memory not reported by the {dev.platform} backend")
    if opts.breakdown:
        result["breakdown"] = run_breakdown(compiled, state, batch, step_s)
    result["wall_s"] = time.time() - t0
    return result


def run_breakdown(compiled, state, batch, step_s: float) -> dict:
    """GPU time by part (benchmarks/e2e_parts.py) of the compiled step, traced pipelined; the
    HLO's instruction count by part is kept too (it needs no GPU)."""
    hlo = compiled.as_text()
    out = dict(hlo_instructions=e2e_parts.hlo_parts(hlo))
    holder = [state]

    def step(b):  # the step donates its state: carry it over
        holder[0], m = compiled(holder[0], b)
        return m

    try:
        res = layer_breakdown.breakdown(step, (batch, ), hlo, reps=3, classify=e2e_parts.part_of)
        res["step_ms"] = step_s * 1e3
        out.update(res)
    except trace.NoGpuEvents as ex:
        out["skipped"] = f"no GPU kernels in the trace: {ex}"
    except Exception as ex:  # noqa: BLE001 - the breakdown is a diagnostic
        traceback.print_exc()
        out["skipped"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
    return out


def table(r: dict) -> str:
    """The result as a few lines of text (the JSON has everything)."""
    f = r["flops"]
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    mem = (f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"
           if r["peak_memory_bytes"] is not None else "n/a")
    lines = [
        "| exp | attention | remat | tokens/s | step ms | TFLOP/s | MFU | peak mem | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['exp']} | {r['attention_impl']} | {r['remat']} | {r['tokens_per_sec']:,.0f} | "
        f"{r['step_ms']:.1f} | {r['tflops_per_sec']:.1f} | {mfu} | {mem} | "
        f"{r['compile_s']:.0f} |",
        f"model FLOPs per token = {f['formula']} = 6 x {f['active_params']:,.0f} + 12 x "
        f"{f['layers']} x {f['seq_len']} x {f['attention_width']} = "
        f"{f['flops_per_token'] / 1e9:.3f} GFLOP (params {f['params']:,}, expert weights "
        f"{f['expert_params']:,} counted x {f['top_k']}/{f['num_experts']})",
        f"device {r['meta']['device']}; peak {r['peak_tflops']} TFLOP/s dense bf16",
    ]
    if changes(r):
        lines.append("config changes: " + changes(r))
    lines += r["attention_routes"]
    lines += [f"note: {n}" for n in r["notes"]]
    bd = r.get("breakdown")
    if bd and "stages" in bd:
        lines.append(
            layer_breakdown.table(f"breakdown {r['exp']}", bd, bd["step_ms"], e2e_parts.ORDER))
        for part in e2e_parts.ORDER:
            top = bd["top_kernels"].get(part)
            if top:
                lines.append(f"  {part}: " + "; ".join(f"{n} {ms:.3f} ms" for n, ms in top))
    elif bd:
        lines.append(f"breakdown skipped: {bd.get('skipped')}; HLO instructions by part: "
                     f"{bd['hlo_instructions']}")
    return "\n".join(lines)


def changes(r: dict) -> str:
    """The run's config changes beyond --attention and --remat: --stack and the --fdl_set."""
    stack = [f"--stack {r['stack']}"] if r.get("stack_changed") else []
    return " ".join(stack + list(r.get("fdl_set") or []))


def summary(results: list[dict]) -> str:
    """One row per result (JSON written by this module), in the order given."""
    lines = [
        "| exp | attention | remat | config changes | tokens/s | step ms | GFLOP/token | TFLOP/s "
        "| MFU | peak mem GiB | device |", "|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        mem = r.get("peak_memory_bytes")
        mem = f"{mem / 2**30:.1f}" if mem is not None else "n/a"
        lines.append(f"| {r['exp']} | {r['attention_impl']} | {r['remat']} | "
                     f"{changes(r) or '-'} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['step_ms']:.1f} | "
                     f"{r['flops']['flops_per_token'] / 1e9:.3f} | {r['tflops_per_sec']:.1f} | "
                     f"{mfu} | {mem} | {r['meta']['device']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.summary:
        paths = sorted(glob.glob(os.path.join(opts.summary, "e2e_*.json")), key=os.path.getmtime)
        results = []
        for path in paths:
            with open(path) as fh:
                results.append(json.load(fh))
        print(summary(results) if results else f"no e2e_*.json under {opts.summary}")
        return 0
    result = run(opts)
    print(table(result), flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
