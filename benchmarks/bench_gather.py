"""The gathered grouped GEMM kernels against the TMA kernels on permuted rows.

    python -m benchmarks.bench_gather [--shapes qwen3,deepseek_ep4] [--dists balanced,skewed]
                                      [--reps 7] [--json FILE]

On one Hopper GPU, per shape of benchmarks.layer (T tokens, K = d_model, N = d_ff, E experts,
k = top_k; R = T*k expert-sorted rows, a random row map of every token k times) and group distribution, times
(benchmarks.timing.time_paired, interleaved rounds, median):

  gather fwd       ops.gathered_gemm.cuda_fwd(x, row_map, w): A read from x by row index
  tma fwd          ops.grouped_gemm.cuda_fwd(x[row_map], w) on rows permuted beforehand
  permute+tma fwd  the same with the permute (ops.permute) in the timed call: the work the
                   gathered forward replaces
  gather wgrad     ops.gathered_gemm.cuda_wgrad(x, row_map, dout)
  tma wgrad        ops.grouped_gemm.cuda_wgrad(x[row_map], dout)

all at the gathered kernels' configuration (gathered_gemm.gather_config: the rule's tile where
a gathered kernel is built for it), and prints a table (ms, TFLOP/s, time / the TMA kernel's)
after checking each gathered output against the TMA kernel's on the same rows (||a - b|| / ||b||
under 1e-2; the two sum in the same order, so the difference is bf16 rounding at most). Writes
the rows as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.grouped_gemm_cases import group_sizes
from benchmarks.layer_cases import SHAPES
from benchmarks.timing import rel_err, time_paired
from moe_praxis.ops.permute import permute_cuda

ga = importlib.import_module("moe_praxis.ops.gathered_gemm")
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")

CHECK_TOL = 1e-2


def _inputs(t, k, n, e, top_k, dist):
    """x, a random row map of every token top_k times, w, dout (drawn on the device: at the
    DeepSeek-like shapes w alone is 0.9 G values) and the group sizes."""
    r = t * top_k
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (t, k), jnp.bfloat16)
    rng = np.random.default_rng(0)
    row_map = jnp.asarray(rng.permutation(np.repeat(np.arange(t), top_k)).astype(np.int32))
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dout = jax.random.normal(kd, (r, n), jnp.bfloat16)
    gs = jnp.asarray(group_sizes(dist, r, e))
    return x, row_map, w, dout, gs


def point_fns(sh, dist):
    """({label: jitted fn(x, row_map)}, x, row_map, GEMM FLOPs, (fwd config, wgrad config))
    of one benchmarks.layer_cases.Shape and group distribution."""
    t, k, n, e, top_k = sh.t, sh.m, sh.h, sh.e, sh.k
    r = t * top_k
    x, row_map, w, dout, gs = _inputs(t, k, n, e, top_k, dist)
    cf, cw = ga.gather_config("fwd", r, k, n, e), ga.gather_config("wgrad", r, k, n, e)
    rows = x[row_map]
    fns = {
        "gather fwd": jax.jit(lambda x, m: ga.cuda_fwd(x, m, w, gs, cf)),
        "tma fwd": jax.jit(lambda x, m: gg.cuda_fwd(rows, w, gs, cf)),
        "permute+tma fwd": jax.jit(lambda x, m: gg.cuda_fwd(permute_cuda(x, m, None), w, gs, cf)),
        "gather wgrad": jax.jit(lambda x, m: ga.cuda_wgrad(x, m, dout, gs, cw)),
        "tma wgrad": jax.jit(lambda x, m: gg.cuda_wgrad(rows, dout, gs, cw)),
    }
    return fns, x, row_map, 2.0 * r * k * n, (cf, cw)


def run_point(name, dist, reps):
    fns, x, row_map, flops, (cf, cw) = point_fns(SHAPES[name], dist)
    errs = {
        "gather fwd": rel_err(fns["gather fwd"](x, row_map), fns["tma fwd"](x, row_map)),
        "gather wgrad": rel_err(fns["gather wgrad"](x, row_map), fns["tma wgrad"](x, row_map)),
    }
    for label, err in errs.items():
        if err is None or err > CHECK_TOL:
            raise SystemExit(f"check {name} {dist} {label} against the TMA kernel: "
                             f"rel err {err} > {CHECK_TOL}")
    secs = time_paired(fns, x, row_map, reps=reps, min_sample_s=0.02, spin_up_s=0.5)
    out = []
    for label, s in secs.items():
        base = secs["tma wgrad" if "wgrad" in label else "tma fwd"]
        out.append(
            dict(shape=name,
                 dist=dist,
                 op=label,
                 ms=s * 1e3,
                 tflops=flops / s / 1e12,
                 x_tma=s / base,
                 config=cw if "wgrad" in label else cf,
                 rel_err_vs_tma=errs.get(label)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gather")
    ap.add_argument("--shapes", default="qwen3,deepseek_ep4")
    ap.add_argument("--dists", default="balanced,skewed")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes {','.join(bad)} is invalid; valid: {','.join(SHAPES)}")
    rows = []
    print(
        "| shape | dist | op | ms | TFLOP/s | x TMA kernel | config |\n|---|---|---|---|---|---|---|"
    )
    for name in shapes:
        for dist in args.dists.split(","):
            for row in run_point(name, dist, args.reps):
                rows.append(row)
                print(f"| {name} | {dist} | {row['op']} | {row['ms']:.3f} | {row['tflops']:.0f} "
                      f"| {row['x_tma']:.2f} | {row['config']} |")
    if args.json:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=str(jax.devices()[0].device_kind),
                    jax=jax.__version__,
                    python=platform.python_version())
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
