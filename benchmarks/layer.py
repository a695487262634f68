"""The whole MoE layer on one device: `python -m benchmarks.layer`.

    python -m benchmarks.layer [--shapes mixtral,qwen3,deepseek] [--methods LIST]
        [--skew | --no-skew] [--breakdown] [--json PATH] [--quick] [--reps N]
        [--gshard-groups 8,32,128] [--tokens 4096,...,65536] [--time-budget SECONDS]

Shapes (bf16 x and expert weights, float32 router; `layer_cases.SHAPES`):
  mixtral   T=16384, M=4096, H=14336, E=8,   k=2, softmax top-k
  qwen3     T=16384, M=2048, H=768,   E=128, k=8, softmax top-k
  deepseek  T=8192,  M=7168, H=2048,  E=256, k=8, sigmoid, 8 expert groups top-4, expert bias,
            routed scaling 2.5
  deepseek_ep4  the same with E=64: one EP-4 rank's experts (about 1024 rows per expert)
--tokens T1,T2,...: the token-count sweep (benchmarks/layer_sweep.py): every shape at each T
instead of its own (rows carry `tokens`); the sweep table gives each (shape, method, pass)'s
share of ideal per T and its largest distance from the share at T=16384 (target: <= 5 points).
Each at balanced load (a random router) and, with --skew (the default), skewed: a router column
and an input offset make the busiest expert take 4x the mean load T*k/E (every token where that
is more than T), read back from moe_block's tokens_per_expert and printed.

Methods (`--methods`, all by default), each timed in its fwd and fwd+bwd pass:
  cuda, cuda+fuse      moe_block, kernel_backend 'cuda', without / with fuse_gate_up
  cuda+bf16router      moe_block, 'cuda', router_precision='bf16'
  cuda+gather          moe_block, 'cuda', gather_combine=True (the routing weights in
                       one gather-and-sum combine kernel, kernels/combine.cu, not in the SwiGLU)
  cuda+regather, cuda+fuse+regather, cuda+dswiglu+regather
                       moe_block, 'cuda', regather_rows=True, alone / with fuse_gate_up / with
                       fuse_swiglu_bwd
                       (the backward permutes x again instead of keeping the rows: act GB)
  cuda+dswiglu, cuda+fuse+dswiglu
                       moe_block, 'cuda', fuse_swiglu_bwd=True, without / with fuse_gate_up
                       (dSwiGLU in the down projection's dgrad epilogue,
                       kernels/grouped_gemm_dswiglu.cu; no SwiGLU backward kernel)
  cuda+fp8             moe_block, 'cuda', fp8='blockwise' (the FP8 expert GEMM kernels;
                       target: Mixtral-like fwd+bwd >= 1.35x 'cuda', column x cuda in the JSON);
                       fp8_gemms 'auto': which GEMMs run FP8 is printed per shape and in the
                       JSON's 'fp8_gemms' {shape: {method: {weight: {fwd|dgrad|wgrad: fp8|bf16}}}}
  cuda+fp8all          'cuda+fp8' with fp8_gemms='all' (every expert GEMM in FP8)
  cuda+fp8-wo-fwd-bf16 'cuda+fp8' with fp8_gemms='wi=all,wo=dgrad+wgrad' (every expert GEMM in
                       FP8 but the down projection's forward, which trained worse in FP8)
  cuda+fp8w, fp8-quant 'cuda+fp8' with the expert weights' FP8 form made beforehand, and that
                       quantization alone: with --microbatches N1,N2 (default 1,8) the rows
                       'cuda+fp8 @n' = cuda+fp8w + fp8-quant / n, weights quantized once per
                       optimizer step of n micro-batches (benchmarks/layer_fp8w.py)
  cuda-sm80            moe_block, 'cuda', the sm_80 grouped GEMM kernels forced while its steps
                       are traced (ops.backend.force_grouped_gemm, lc.GROUPED_GEMM_FAMILY): the
                       Ampere kernels' whole layer, on a Hopper GPU beside 'cuda'
  xla                  moe_block, kernel_backend 'xla' (RESOURCE_EXHAUSTED is caught: 'OOM')
  layer, layer+fuse    MoEFeedForward (layer norm + moe_block + residual), 'cuda', with each
                       shape's own routing (lc.layer_template: the layer's routing fields)
  gshard               Praxis's TransformerFeedForwardMoe (GShard top-2, gated SiLU) at the
                       Mixtral shape, balanced load: capacity factor 2.5 in Praxis's per-token
                       convention (= 1.25 per copy) and Praxis's default 2.0, both at the
                       num_groups of --gshard-groups where cf 2.5 runs fwd+bwd fastest (each
                       timed alone), with the share of copies it drops
  torch, torch compile, torch ideal
                       the PyTorch peer (benchmarks/layer_torch.py): a TorchTitan-style layer
                       (stable sort by expert, row gather, torch._grouped_mm with device offsets,
                       index_add_ combine), eager and torch.compile'd, timed with CUDA events
                       after the JAX methods, checked against 'xla' first; 'torch ideal' is
                       torch's own dense GEMMs of the expert shapes. Without PyTorch or a GPU
                       for it: skipped with one line. Column x torch: the faster torch row / ms
  ideal                the dense bf16 GEMMs of the expert shapes on T*k rows: 3 (fwd) or 9
                       (fwd+bwd); and the roofline ideal (computed, not timed): the ideal plus
                       reading the expert weights once (fwd) or twice and writing their
                       gradients once (fwd+bwd), at the copy bandwidth measured in the same run
The 'cuda' methods run with kernel_backend 'xla' where CUDA is unusable (--quick; the output
says so). fwd = jit(moe_block) (or the layer's apply); fwd+bwd = jit(value_and_grad) of
sum(y * cot) + aux losses w.r.t. the parameters and x.

Before timing, each shape checks 'cuda', 'cuda+fuse', 'cuda+gather', 'cuda+dswiglu', 'cuda+fuse+dswiglu', 'cuda-sm80' and 'cuda+fp8'
against 'xla' (y,
dx and the weight gradients, ||a - b|| / ||b||, bf16 tolerance 2e-2, FP8 0.08: tests/test_fp8.py's
bound) on the first tokens (the full
'xla' layer does not fit everywhere); an FP8 method whose timed call runs FP8 is checked with
its weights' FP8 form given, so the slice runs the same FP8 GEMMs (benchmarks.layer_check).
Timing: every executable compiled once
(jit(...).lower().compile()), warmed up, then all the methods of one (shape, load, pass) timed
in interleaved batches (benchmarks.timing.time_paired: median of --reps rounds).

Columns: ms; TFLOP/s of the expert FLOPs (2 * T*k * M * H * 3, x3 for fwd+bwd); % of ideal
(ideal ms / ms); % of roofline; x GShard (GShard cf 2.5 ms / ms, Mixtral, balanced); peak
device memory of the executable (XLA's memory analysis: arguments + outputs + temporaries -
aliased) and its temporaries alone (act GB: what the step keeps and works in beyond the
weights, inputs, gradients and outputs); target and PASS/FAIL against the layer's targets
(fwd+bwd, 'cuda' and 'cuda+fuse'): Qwen3-like >= 80% of ideal; DeepSeek-V3-like >= 75% of
ideal or >= 90% of the roofline; Mixtral-like >= 95% of ideal and >= 1.25x GShard; skewed load
within 15% of the balanced time. Speed is asserted here, in the output, never in a test.

--breakdown: per-stage GPU time of the balanced fwd+bwd step of 'cuda', 'cuda+fuse', 'cuda+gather',
'cuda+dswiglu', 'cuda+fuse+dswiglu' and 'cuda+fp8' from a
profiler trace (benchmarks/layer_breakdown.py: the stage table); where the trace has no GPU
kernels (the CPU) it prints why and goes on.
--quick: CPU sizes (layer_cases.QUICK_SHAPES), 2 rounds, small copy-bandwidth buffer: the
end-to-end smoke test (tests/test_layer_bench.py).
Each moe_block method's plan (moe_praxis.describe_plan: dispatcher, experts, combiner and
why) is printed per shape and written to the JSON's 'plans' {shape: {method: text}}.
JSON (--json, default benchmarks/results/layer_bench.json): meta (date, versions, device,
copy bandwidth), notes, checks, skew, rows, breakdown; rewritten after every (shape, load,
pass).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import jaxlib

from benchmarks import bench_kernels, layer_breakdown, layer_fp8w, layer_report, layer_sweep
from benchmarks import layer_torch
from benchmarks import layer_cases as lc
from benchmarks.layer_check import CHECKED, _failure, _is_oom, check_against_xla
from benchmarks import gpu_clocks, trace
from benchmarks.timing import time_fn, time_paired
import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops import backend as ops_backend


def compile_step(fn, args):
    """(compiled, memory): jit's AOT compile, and XLA's memory analysis of it as row fields:
    peak_bytes (arguments + outputs + temporaries - aliased) and temp_bytes (the temporaries
    alone: the activations the backward keeps, the workspaces; what a step adds to the weights,
    inputs, gradients and outputs); {} where the backend has no analysis (the columns say -)."""
    compiled = fn.lower(*args).compile()
    try:
        ma = compiled.memory_analysis()
        mem = dict(peak_bytes=ma.argument_size_in_bytes + ma.output_size_in_bytes +
                   ma.temp_size_in_bytes - ma.alias_size_in_bytes,
                   temp_bytes=ma.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        mem = {}
    return compiled, mem


class Shape:
    """One shape's arrays and executables: `steps[(method, pass)] = (compiled, memory)` and
    `args(method, pass, load)` (the skewed load only changes values: same executables)."""

    def __init__(self, name, shape, methods, backend, key):
        self.name, self.shape, self.methods, self.backend = name, shape, methods, backend
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.params = lc.make_params(shape, k1)
        self.x = jax.random.normal(k2, (shape.t, shape.m), jnp.bfloat16)
        self.cot = jax.random.normal(k3, (shape.t, shape.m), jnp.bfloat16)
        self.fused = lc.fused_params(self.params) if any("fuse" in m for m in methods) else None
        self.ideal = lc.ideal_args(shape, k4) if "ideal" in methods else None
        self.skew_key = k5
        self.skew = None  # (router, offset, ratio by bisection)
        self.layers = {}  # method -> (fns, variables)
        self.steps = {}
        self.failed = {}  # (method, pass) -> why it failed (OOM, an error)
        self.fp8w = None  # the expert weights' FP8 form (layer_fp8w), made once

    def block_params(self, method, load):
        p = self.fused if "fuse" in method else self.params
        if load == "skewed":
            p = {**p, "router": self.skew[0]}
        return p

    def args(self, method, pass_, load):
        if method == "ideal":
            return self.ideal
        x = self.x
        if method in self.layers:
            fns, variables = self.layers[method]
            v = dict(variables)
            if load == "skewed":
                prm = dict(v["params"], router=self.skew[0])
                ln = dict(prm["layer_norm"])
                ln["bias"] = self.skew[1].astype(ln["bias"].dtype)
                prm["layer_norm"] = ln
                v["params"] = prm
            x3, c3 = lc.layer_x(self.shape, x), lc.layer_x(self.shape, self.cot)
            return (v, x3) if pass_ == "fwd" else (v, x3, c3)
        if load == "skewed":
            x = (x.astype(jnp.float32) + self.skew[1]).astype(x.dtype)
        p = self.block_params(method, load)
        if method == layer_fp8w.QUANTIZE:
            return (self.params, )
        if method == layer_fp8w.PREQUANTIZED:
            if self.fp8w is None:
                self.fp8w = self.fns(method)["quantize"](self.params)
            return (p, self.fp8w, x) if pass_ == "fwd" else (p, self.fp8w, x, self.cot)
        return (p, x) if pass_ == "fwd" else (p, x, self.cot)

    def config(self, method, **extra):
        fields, _ = lc.BLOCK_METHODS["cuda+fp8" if method in layer_fp8w.METHODS else method]
        fields = dict(fields, **extra)
        if fields.get("kernel_backend") == "cuda":
            fields["kernel_backend"] = self.backend
        return lc.config(self.shape, **fields)

    def forcing(self, method):
        """The context `method`'s steps are traced in: its grouped GEMM kernel family forced
        (lc.GROUPED_GEMM_FAMILY) or none."""
        return ops_backend.force_grouped_gemm(lc.GROUPED_GEMM_FAMILY.get(method))

    def fns(self, method):
        if method == "ideal":
            return lc.ideal_fns()
        if method in layer_fp8w.METHODS:
            f = layer_fp8w.fns(self.config(method))
            return f if method == layer_fp8w.PREQUANTIZED else dict.fromkeys(
                lc.PASSES, f["quantize"])
        fields, is_layer = lc.BLOCK_METHODS[method]
        if is_layer:
            if method not in self.layers:
                p = self.fused if "fuse" in method else self.params
                self.layers[method] = lc.moe_layer(self.shape,
                                                   p,
                                                   lc.layer_x(self.shape, self.x),
                                                   fuse="fuse" in method,
                                                   backend=self.config(method).kernel_backend)
            return self.layers[method][0]
        return lc.block_fns(self.config(method))


def plans(sh: Shape, methods) -> dict:
    """{method: the plan moe_block resolves for it at this shape (moe_praxis.describe_plan:
    dispatcher, experts, combiner and why)} of the moe_block methods, each printed; the JSON's
    'plans' {shape: {method: text}}."""
    x = jax.ShapeDtypeStruct((sh.shape.t, sh.shape.m), jnp.bfloat16)
    out = {}
    for method in methods:
        if method not in lc.BLOCK_METHODS or lc.BLOCK_METHODS[method][1]:
            continue
        with sh.forcing(method):
            out[method] = mp.describe_plan(sh.config(method), x)
        print(f"{method}: " + "; ".join(out[method].splitlines()[2:5]), flush=True)
    return out


def measure_skew(sh: Shape) -> dict:
    """Builds the skewed router and offset, then reads the skew back from tokens_per_expert."""
    sh.skew = lc.skew_inputs(sh.shape, sh.params, sh.x, sh.skew_key)
    method = "cuda" if "cuda" in sh.methods else "xla"
    if (method, "fwd") not in sh.steps:  # the timed executable, compiled once
        args = sh.args(method, "fwd", "balanced")
        sh.steps[(method, "fwd")] = compile_step(lc.block_fns(sh.config(method))["fwd"], args)
    f = sh.steps[(method, "fwd")][0]
    res = {}
    for load in ("balanced", "skewed"):
        counts = f(*sh.args(method, "fwd", load)).tokens_per_expert
        counts = [int(c) for c in jax.device_get(counts)]
        mean = sum(counts) / len(counts)
        res[load] = dict(max_over_mean=max(counts) / mean, busiest=max(counts), mean=mean)
    res["bisection_ratio"] = sh.skew[2]
    print(
        f"skew {sh.name}: busiest expert / mean load = {res['balanced']['max_over_mean']:.2f} "
        f"balanced, {res['skewed']['max_over_mean']:.2f} skewed (target "
        f"{min(lc.SKEW_RATIO, sh.shape.e / sh.shape.k):.2f}; from tokens_per_expert)",
        flush=True)
    return res


def _gshard_sweep(sh: Shape, opts) -> int | None:
    """The num_groups of opts.gshard_groups where GShard (cf 2.5) runs fwd+bwd fastest, each
    timed alone; None if none ran."""
    x3, c3 = lc.layer_x(sh.shape, sh.x), lc.layer_x(sh.shape, sh.cot)
    cands = []
    for g in opts.gshard_groups:
        if sh.shape.t % g:
            print(f"  gshard num_groups={g}: skipped, does not divide T={sh.shape.t}", flush=True)
            continue
        try:
            fns, v = lc.gshard_layer(sh.shape, sh.params, x3, cf=2.5, groups=g)
            comp, _ = compile_step(fns["fwd+bwd"], (v, x3, c3))
            secs = time_fn(lambda: comp(v, x3, c3), target_s=opts.target_s, reps=3)
            print(f"  gshard cf=2.5 num_groups={g}: {secs * 1e3:.3f} ms fwd+bwd", flush=True)
            cands.append((secs, g))
        except Exception as ex:  # noqa: BLE001
            print(f"  gshard cf=2.5 num_groups={g}: {_failure(ex)}", flush=True)
    return min(cands)[1] if cands else None


def gshard_rows(sh: Shape, opts, pass_: str) -> dict:
    """{label: (compiled, args, memory, extra)} of GShard at cf 2.5 and 2.0, both at the
    num_groups of the sweep at 2.5 (_gshard_sweep), with the share of copies each drops."""
    out = {}
    x3, c3 = lc.layer_x(sh.shape, sh.x), lc.layer_x(sh.shape, sh.cot)
    if "gshard groups" not in sh.steps:
        sh.steps["gshard groups"] = _gshard_sweep(sh, opts)
    groups = sh.steps["gshard groups"]
    if groups is None:
        return out
    for cf in (2.5, 2.0):
        try:
            if ("gshard", cf) not in sh.steps:
                fns, v = lc.gshard_layer(sh.shape, sh.params, x3, cf=cf, groups=groups)
                sh.steps[("gshard", cf)] = dict(fns=fns,
                                                variables=v,
                                                dropped=lc.gshard_dropped(fns["fwd"](v, x3)[2]))
            best = sh.steps[("gshard", cf)]
            v = best["variables"]
            args = (v, x3) if pass_ == "fwd" else (v, x3, c3)
            if pass_ not in best:
                best[pass_] = compile_step(best["fns"][pass_], args)
            comp, mem = best[pass_]
            out[f"gshard cf{cf}"] = (comp, args, mem,
                                     dict(num_groups=groups, dropped=best["dropped"]))
        except Exception as ex:  # noqa: BLE001
            print(f"  gshard cf={cf} {pass_}: {_failure(ex)}", flush=True)
    return out


def time_unit(sh: Shape, opts, load: str, pass_: str) -> list[dict]:
    """All methods of one (shape, load, pass), timed interleaved -> rows."""
    timed, rows = {}, []
    for method in sh.methods:
        if method in ("gshard", "torch"):
            continue
        row = dict(shape=sh.name, load=load, pass_=pass_, method=method)
        key = (method, pass_)
        if key in sh.failed:  # failed at the balanced load: not compiled or run again
            row["status"] = sh.failed[key]
            rows.append(row)
            continue
        try:
            if key not in sh.steps:
                fns = sh.fns(method)  # builds the Praxis layer's variables first
                with sh.forcing(method):
                    sh.steps[key] = compile_step(fns[pass_], sh.args(method, pass_, load))
            args = sh.args(method, pass_, load)
            comp, mem = sh.steps[key]
            row.update(mem)
            jax.block_until_ready(comp(*args))
            timed[method] = (comp, args)
        except Exception as ex:  # noqa: BLE001
            if not _is_oom(ex):
                traceback.print_exc()
            row["status"] = sh.failed[key] = _failure(ex)
            print(f"  {sh.name} {load} {pass_} {method}: {row['status']}", flush=True)
        rows.append(row)
    if "gshard" in sh.methods and layer_sweep.base_name(sh.name) == "mixtral" and \
            load == "balanced":
        for label, (comp, args, mem, extra) in gshard_rows(sh, opts, pass_).items():
            timed[label] = (comp, args)
            rows.append(dict(shape=sh.name, load=load, pass_=pass_, method=label, **mem, **extra))
    fns = {m: (lambda c=c, a=a: c(*a)) for m, (c, a) in timed.items()}
    with gpu_clocks.Sampler() as sampler:
        secs = _timed(fns, rows, opts)
    c = sampler.summary()  # the unit's SM MHz and W (None: not sampled)
    if c:
        print(
            f"  {sh.name} {load} {pass_}: SM {c['sm_mhz'][0]:.0f}-{c['sm_mhz'][2]:.0f} MHz "
            f"(median {c['sm_mhz'][1]:.0f}), {c['power_w'][1]:.0f} W median",
            flush=True)
    for r in rows:
        if secs.get(r["method"]) is not None:
            r["ms"] = secs[r["method"]] * 1e3
            r.setdefault("status", "ok")
            r["gpu_clocks"] = c
    return rows


def _timed(fns, rows, opts) -> dict:
    """{method: seconds or None}: fns timed interleaved, or each alone where that fails (a
    method failing alone gets its row's status)."""
    try:
        return time_paired(fns, target_s=opts.target_s, reps=opts.reps)
    except Exception as ex:  # noqa: BLE001 - e.g. out of memory with all of them live
        print(f"  interleaved timing failed ({_failure(ex)}): timing each alone", flush=True)
    secs = {}
    for m, f in fns.items():
        try:
            secs[m] = time_fn(f, target_s=opts.target_s, reps=opts.reps)
        except Exception as ex2:  # noqa: BLE001
            secs[m] = None
            for r in rows:
                if r["method"] == m:
                    r["status"] = _failure(ex2)
    return secs


def main(argv=None) -> int:
    opts = layer_report.parse_args(argv)
    t0 = time.time()
    if "torch" in opts.methods:  # torch allocates beside JAX: no preallocated 75% for JAX
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        why = layer_torch.unavailable()
        if why:
            print(f"note: method 'torch' skipped: {why}", flush=True)
            opts.methods = [m for m in opts.methods if m != "torch"]
    cuda = ops.backend_info()["cuda"]
    backend = "cuda" if cuda["usable"] and not opts.quick else "xla"
    notes = []
    if backend == "xla" and any(m in lc.BLOCK_METHODS and m != "xla" for m in opts.methods):
        notes.append(f"the 'cuda' methods run with kernel_backend='xla' here "
                     f"({'--quick' if opts.quick else 'CUDA unusable: ' + str(cuda['reason'])})")
    dev = jax.devices()[0]
    n_el = (1 << 20) if opts.quick else (1 << 29)
    copy_bw = bench_kernels.copy_bandwidth(2 if opts.quick else 5, n_el=n_el)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.device_kind,
                platform=dev.platform,
                jax=jax.__version__,
                jaxlib=jaxlib.__version__,
                python=platform.python_version(),
                library=cuda["reason"],
                backend=backend,
                copy_bw=copy_bw,
                quick=opts.quick,
                argv=sys.argv[1:] if argv is None else list(argv))
    print(json.dumps(meta), flush=True)
    for n in notes:
        print("note:", n, flush=True)
    result = dict(meta=meta, notes=notes, checks=[], skew={}, rows=[], breakdown={})
    shapes = lc.QUICK_SHAPES if opts.quick else lc.SHAPES
    if "gshard" in opts.methods and "mixtral" not in opts.shapes:
        notes.append("gshard runs at the Mixtral shape only: not run")
    for i, (name, shape) in enumerate(layer_sweep.runs(opts.shapes, shapes, opts.tokens)):
        if time.time() - t0 > opts.time_budget:
            notes.append(f"--time-budget {opts.time_budget:.0f} s reached: shapes from "
                         f"{name!r} on not run")
            break
        methods = opts.methods
        fp8_methods = ("cuda+fp8", "cuda+fp8all", "cuda+fp8-wo-fwd-bf16") + layer_fp8w.METHODS
        if set(fp8_methods) & set(methods) and (shape.m % 128 or shape.h % 128):
            methods = [m for m in methods if m not in fp8_methods]
            notes.append(f"cuda+fp8 not run at {name}: FP8 needs d_model and d_ff multiples of "
                         "128 (the 128 x 128 weight blocks)")
        sh = Shape(name, shape, methods, backend, jax.random.key(i))
        print(f"\n== {name}: {shape}", flush=True)
        rows_per_expert = shape.t * shape.k / shape.e  # one call's
        result.setdefault("gemm_configs", {})[name] = layer_report.gemm_configs(shape)
        result.setdefault("fp8_gemms", {})[name] = layer_report.fp8_gemms(
            {m: sh.config(m)
             for m in methods if m in fp8_methods}, rows_per_expert)
        result.setdefault("plans", {})[name] = plans(sh, methods)
        # the check needs no 'xla' method: it runs the 'xla' layer on a slice of its own
        if any(m in CHECKED for m in methods):
            result["checks"] += check_against_xla(sh)
        loads = ["balanced"]
        if opts.skew:
            result["skew"][name] = measure_skew(sh)
            loads.append("skewed")
        for load in loads:
            by_pass = {p: time_unit(sh, opts, load, p) for p in lc.PASSES}
            if "torch" in methods:  # after the JAX methods, in the same process
                trows, check = layer_torch.rows(sh, load, opts.reps)
                if check is not None:
                    result["checks"].append(dict(shape=name, method="torch", **check))
                    print(f"check {name} torch against xla: {check}", flush=True)
                for r in trows:
                    by_pass[r["pass_"]].append(r)
            for pass_, rows in by_pass.items():
                rows += layer_fp8w.amortized(rows, opts.microbatches, rows_per_expert)
                layer_report.derive(rows, sh.shape, pass_, copy_bw)
                layer_torch.x_torch(rows)
                for r in rows:
                    r["tokens"] = shape.t
                if load == "skewed":
                    for r in rows:
                        r["skew_max_over_mean"] = result["skew"][name]["skewed"]["max_over_mean"]
                result["rows"] += rows
                layer_report.print_rows(rows)
                layer_report.write(opts.json, result)  # a run cut short keeps what it timed
        if opts.breakdown:
            result["breakdown"][name] = run_breakdown(sh)
        layer_report.write(opts.json, result)
        del sh
        gc.collect()  # the shape's arrays go before the next shape's are made
    result["targets"] = layer_report.targets(result["rows"])
    print("\n" + layer_report.table(result["rows"]))
    if opts.tokens:
        result["sweep"] = layer_sweep.summary(result["rows"])
        print("\n" + layer_sweep.table(result["sweep"]))
    for n in notes:
        print("note:", n)
    layer_report.write(opts.json, result)
    print(f"wrote {opts.json} in {time.time() - t0:.0f} s")
    return 0


def run_breakdown(sh: Shape) -> dict:
    out = {}
    for method in ("cuda", "cuda+fuse", "cuda+gather", "cuda+dswiglu", "cuda+fuse+dswiglu",
                   "cuda+fp8"):
        if (method, "fwd+bwd") not in sh.steps:
            continue
        comp, _ = sh.steps[(method, "fwd+bwd")]
        args = sh.args(method, "fwd+bwd", "balanced")
        try:
            res = layer_breakdown.breakdown(comp, args, comp.as_text())
            step = time_fn(lambda: comp(*args), reps=3)
            res["step_ms"] = step * 1e3
            print(
                "\n" +
                layer_breakdown.table(f"breakdown {sh.name} {method} fwd+bwd", res, res["step_ms"]),
                flush=True)
        except trace.NoGpuEvents as ex:
            res = dict(skipped=f"no GPU kernels in the trace: {ex}")
            print(f"breakdown {sh.name} {method}: skipped, {res['skipped']}", flush=True)
        except Exception as ex:  # noqa: BLE001 - the breakdown is a diagnostic
            traceback.print_exc()
            res = dict(skipped=_failure(ex))
            print(f"breakdown {sh.name} {method}: {res['skipped']}", flush=True)
        out[method] = res
    return out


if __name__ == "__main__":
    sys.exit(main())
