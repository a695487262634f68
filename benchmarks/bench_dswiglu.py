"""Benchmark: dSwiGLU in the down projection's dgrad epilogue (MoEConfig.fuse_swiglu_bwd).

    python -m benchmarks.bench_dswiglu [--out bench_dswiglu.json] [--shapes qwen3,...]
        [--dists balanced,skewed]

On one Hopper GPU, for the layer benchmark's shapes (benchmarks/layer_cases.py: R = T*k rows,
H = d_ff, N = d_model, E experts; bf16, routing weights), balanced and skewed group sizes
(benchmarks/grouped_gemm_cases.py):
  bwd kernels, separate and interleaved (fuse_gate_up) gradient layouts:
    unfused  dact = dgrad(dout, wo) (moe_grouped_gemm_dgrad, the dgrad rule's configuration),
             then the SwiGLU backward (moe_swiglu_bwd / _interleaved) -> dgate, dup, dw
    fused    moe_grouped_gemm_dswiglu(_interleaved) -> dgate, dup, act, dw (it also writes the
             recomputed activation the down projection's wgrad reads)
  op fwd+bwd: jax.vjp of grouped_gemm(swiglu(gate, up, w), wo) (unfused ops) against
    ops.swiglu_down (d gate, d up, d w, d wo), with a random cotangent.
Before timing, the fused outputs are compared with the unfused ones (||a - b|| / ||b||; dgate,
dup and act are expected to be bitwise equal, dw to float32 summation order). Times: median
seconds per call inside one jitted function (benchmarks.timing.time_fn). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.grouped_gemm_cases import group_sizes
from benchmarks.layer_cases import SHAPES
from benchmarks.timing import rel_err, time_fn
from moe_praxis import ops
from moe_praxis.ops import grouped_gemm as gg
from moe_praxis.ops import dswiglu as sd
from moe_praxis.ops.swiglu import swiglu_bwd_ffi


def _inputs(e, r, h, n, dist):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    gate = jax.random.normal(k1, (r, h), jnp.bfloat16)
    up = jax.random.normal(k2, (r, h), jnp.bfloat16)
    wo = (jax.random.normal(k3, (e, h, n), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    w = jax.random.uniform(k4, (r, ), jnp.float32, 0.1, 1.0)
    dout = jax.random.normal(k5, (r, n), jnp.bfloat16)
    return gate, up, wo, w, dout, jnp.asarray(group_sizes(dist, r, e))


def _kernels(gate, up, wo, w, dout, gs, interleaved):
    """(unfused fn, fused fn, fused config) of the backward kernels."""
    r, h = gate.shape
    e, n = wo.shape[0], wo.shape[2]
    dcfg = gg.choose_config("dgrad", r, h, n, e)
    fcfg = sd.choose_config(r, h, n, e)

    def unfused(gate, up, wo, w, dout, gs):
        dact = gg.cuda_dgrad(dout, wo, gs, dcfg)
        return swiglu_bwd_ffi(gate, up, w, dact, True, interleaved=interleaved)

    def fused(gate, up, wo, w, dout, gs):
        grads, act, dw = sd.cuda_dswiglu_dgrad(dout,
                                               wo,
                                               gs,
                                               gate,
                                               up,
                                               w,
                                               has_weight=True,
                                               interleaved=interleaved,
                                               config=fcfg)
        return (grads, act, dw) if interleaved else (*grads, act, dw)

    return jax.jit(unfused), jax.jit(fused), fcfg


def _check(unf, fus, interleaved, gate, up, w):
    """{name: rel err} of the fused outputs against the unfused ones (act against the SwiGLU
    forward kernel)."""
    names = ("dgate_up", ) if interleaved else ("dgate", "dup")
    errs = {nm: rel_err(a, b) for nm, a, b in zip(names, fus, unf)}
    errs["act"] = rel_err(fus[-2], ops.swiglu(gate, up, w, backend="cuda"))
    errs["dw"] = rel_err(fus[-1], unf[-1])
    errs["bitwise_grads"] = all(
        bool(jnp.array_equal(a, b)) for a, b in zip(fus[:len(names)], unf[:len(names)]))
    return errs


def _op_vjps(gs):

    def unfused(gate, up, w, wo, d):
        f = lambda g, u, ww, o: ops.grouped_gemm(  # noqa: E731
            ops.swiglu(g, u, ww, backend="cuda"), o, gs, backend="cuda")
        return jax.vjp(f, gate, up, w, wo)[1](d)

    def fused(gate, up, w, wo, d):
        f = lambda g, u, ww, o: ops.swiglu_down(g, u, o, gs, ww, backend="cuda")  # noqa: E731
        return jax.vjp(f, gate, up, w, wo)[1](d)

    return jax.jit(unfused), jax.jit(fused)


def run_case(name, dist):
    s = SHAPES[name]
    e, r, h, n = s.e, s.t * s.k, s.h, s.m
    gate, up, wo, w, dout, gs = _inputs(e, r, h, n, dist)
    row = dict(shape=name, dist=dist, E=e, rows=r, H=h, N=n, dgrad_flops=2.0 * r * h * n)
    why = sd.fused_reason(gate, wo, "cuda")
    if why:
        raise RuntimeError(f"the fused kernel does not run here: {why}")
    for interleaved in (False, True):
        key = "interleaved" if interleaved else "separate"
        unf, fus, cfg = _kernels(gate, up, wo, w, dout, gs, interleaved)
        args = (gate, up, wo, w, dout, gs)
        errs = _check(unf(*args), fus(*args), interleaved, gate, up, w)
        row[key] = dict(config=cfg,
                        unfused_s=time_fn(unf, *args),
                        fused_s=time_fn(fus, *args),
                        errs=errs)
    unf_op, fus_op = _op_vjps(gs)
    opargs = (gate, up, w, wo, dout)
    row["op_fwdbwd"] = dict(unfused_s=time_fn(unf_op, *opargs), fused_s=time_fn(fus_op, *opargs))
    return row


def table(rows) -> str:
    out = [
        "| shape | groups | layout | config | unfused bwd ms | fused bwd ms | speedup | "
        "max err | bitwise d(gate, up) |", "|---|---|---|---|---|---|---|---|---|"
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['dist']} | failed | | | | | | |")
            continue
        for key in ("separate", "interleaved"):
            c = r[key]
            err = max(v for k, v in c["errs"].items() if k != "bitwise_grads")
            out.append(f"| {r['shape']} | {r['dist']} | {key} | {c['config'].split('/')[0]} | "
                       f"{c['unfused_s'] * 1e3:.3f} | {c['fused_s'] * 1e3:.3f} | "
                       f"{c['unfused_s'] / c['fused_s']:.2f} | {err:.1e} | "
                       f"{c['errs']['bitwise_grads']} |")
        o = r["op_fwdbwd"]
        out.append(f"| {r['shape']} | {r['dist']} | op fwd+bwd | | {o['unfused_s'] * 1e3:.3f} | "
                   f"{o['fused_s'] * 1e3:.3f} | {o['unfused_s'] / o['fused_s']:.2f} | | |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_dswiglu")
    ap.add_argument("--out", default="bench_dswiglu.json")
    ap.add_argument("--shapes", default="qwen3,deepseek_ep4,deepseek,mixtral")
    ap.add_argument("--dists", default="balanced,skewed")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=dev.device_kind,
                jax=jax.__version__,
                python=platform.python_version())
    print(meta, flush=True)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            print(f"--shapes: {name!r} is not a shape; valid: {sorted(SHAPES)}", file=sys.stderr)
            return 2
        for dist in args.dists.split(","):
            try:
                rows.append(run_case(name, dist))
                print("\n".join(table(rows[-1:]).splitlines()[2:]), flush=True)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(shape=name, dist=dist, error=traceback.format_exc()[-2000:]))
    print()
    print(table(rows))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", args.out)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
