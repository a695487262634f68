"""Benchmark: fused gate/up + SwiGLU (MoEConfig.fuse_gate_up) against the unfused path.

    python -m benchmarks.bench_gate_up [--out bench_gate_up.json] [--shapes A,B,C]

On one GPU, for the issue's grouped GEMM shapes (E, M, K, N) with H = N (so the unfused path
is two of the grouped GEMMs of benchmarks.bench_grouped_gemm plus the SwiGLU kernel, the
fused one a grouped GEMM of N = 2H with the SwiGLU in its epilogue), balanced and skewed group
sizes (the same as bench_grouped_gemm), with routing weights:
  fwd:      unfused  gate = gg(x, wi_gate), up = gg(x, wi_up), act = swiglu(gate, up, w)
            fused    (gate, up, act) = gg_swiglu(x, wi_gate_up, w)   per tile in FUSED_TILES
  fwd+bwd:  jax.vjp of each (d x, d weights, d routing weights) with a random cotangent.
Times: median seconds per call inside one jitted function (benchmarks.timing.time_fn).
Prints a table (ms, TFLOP/s of the GEMMs, fused / unfused speedup) and writes JSON.
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

from benchmarks.grouped_gemm_cases import SHAPES, group_sizes
from benchmarks.timing import rel_err, time_fn
from moe_praxis import ops
from moe_praxis.ops import gate_up

gg = gate_up.gg


def _inputs(e, m, k, h, dist):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    wg = (jax.random.normal(k2, (e, k, h), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    wu = (jax.random.normal(k3, (e, k, h), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    w = jax.random.uniform(k4, (m, ), jnp.float32, 0.1, 1.0)
    dact = jax.random.normal(k5, (m, h), jnp.bfloat16)
    gs = jnp.asarray(group_sizes(dist, m, e))
    return x, wg, wu, w, dact, gs


def _unfused_fwd(x, wg, wu, w, gs):
    gate = ops.grouped_gemm(x, wg, gs, backend="cuda")
    up = ops.grouped_gemm(x, wu, gs, backend="cuda")
    return ops.swiglu(gate, up, w, backend="cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gate_up")
    ap.add_argument("--out", default="bench_gate_up.json")
    ap.add_argument("--shapes", default="A,B,C")
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
        e, m, k, h = SHAPES[name]
        flops = 2.0 * m * k * 2 * h  # the two projections
        for dist in args.dists.split(","):
            try:
                x, wg, wu, w, dact, gs = _inputs(e, m, k, h, dist)
                wgu = ops.interleave_gate_up(wg, wu)
                jax.block_until_ready(wgu)
                unf = jax.jit(_unfused_fwd)
                t_unf = time_fn(unf, x, wg, wu, w, gs)
                ref = unf(x, wg, wu, w, gs)
                fused = {}
                for tile in gate_up.FUSED_TILES:
                    cfg = gg.config_name(
                        tile,
                        gg.parse_config(gate_up.choose_fused_config(m, k, 2 * h, e))[1])
                    f = jax.jit(lambda x, b, w, g, c=cfg: gate_up.cuda_fwd(x, b, g, w, True, c)[2])
                    fused[cfg] = (time_fn(f, x, wgu, w, gs), rel_err(f(x, wgu, w, gs), ref))
                chosen = gate_up.choose_fused_config(m, k, 2 * h, e)

                def vjp_unf(x, wg, wu, w, d):
                    return jax.vjp(lambda a, b, c, ww: _unfused_fwd(a, b, c, ww, gs), x, wg, wu,
                                   w)[1](d)

                def vjp_fused(x, wgu, w, d):
                    return jax.vjp(
                        lambda a, b, ww: ops.gate_up_swiglu(a, b, gs, ww, backend="cuda"), x, wgu,
                        w)[1](d)

                t_unf_b = time_fn(jax.jit(vjp_unf), x, wg, wu, w, dact)
                t_fus_b = time_fn(jax.jit(vjp_fused), x, wgu, w, dact)
                row = dict(shape=name,
                           dist=dist,
                           E=e,
                           M=m,
                           K=k,
                           H=h,
                           unfused_fwd_s=t_unf,
                           fused_fwd_s={
                               c: v[0]
                               for c, v in fused.items()
                           },
                           fused_rel_err_vs_unfused={
                               c: v[1]
                               for c, v in fused.items()
                           },
                           chosen=chosen,
                           unfused_fwdbwd_s=t_unf_b,
                           fused_fwdbwd_s=t_fus_b,
                           gemm_flops_fwd=flops)
                rows.append(row)
                tf = fused[chosen][0]
                print(f"{name} {dist}: fwd unfused {t_unf*1e3:.3f} ms, fused " +
                      ", ".join(f"{c} {v[0]*1e3:.3f} ms (err {v[1]:.1e})"
                                for c, v in fused.items()) +
                      f"; chosen {tf*1e3:.3f} -> {t_unf/tf:.2f}x; fwd+bwd unfused "
                      f"{t_unf_b*1e3:.3f} fused {t_fus_b*1e3:.3f} -> {t_unf_b/t_fus_b:.2f}x",
                      flush=True)
                del x, wg, wu, wgu, w, dact, ref
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(shape=name, dist=dist, error=traceback.format_exc()[-2000:]))
    print()
    print("| shape | groups | unfused fwd ms (TFLOP/s) | fused fwd ms (TFLOP/s, config) | "
          "fwd speedup | unfused fwd+bwd ms | fused fwd+bwd ms | fwd+bwd speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['dist']} | failed | | | | | |")
            continue
        tf = r["fused_fwd_s"][r["chosen"]]
        fl = r["gemm_flops_fwd"]
        print(f"| {r['shape']} | {r['dist']} | {r['unfused_fwd_s']*1e3:.3f} "
              f"({fl / r['unfused_fwd_s'] / 1e12:.0f}) | {tf*1e3:.3f} ({fl / tf / 1e12:.0f}, "
              f"{r['chosen'].split('/')[0]}) | {r['unfused_fwd_s']/tf:.2f} | "
              f"{r['unfused_fwdbwd_s']*1e3:.3f} | {r['fused_fwdbwd_s']*1e3:.3f} | "
              f"{r['unfused_fwdbwd_s']/r['fused_fwdbwd_s']:.2f} |")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", args.out)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
