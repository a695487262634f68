"""FP8 grouped GEMM benchmark: `python -m benchmarks.bench_fp8 [--out FILE.json]`.

On one Hopper GPU, at the shapes A, B, C of benchmarks.bench_grouped_gemm (balanced groups
by default; both distributions sum to M, so every row does 2*M*K*N FLOPs), times

  bf16        our bf16 grouped GEMM (ops.grouped_gemm's CUDA kernels, choose_config's tile)
  fp8         our FP8 grouped GEMM kernel alone on operands quantized beforehand
              (ops.fp8.gemm: fwd = nt(L1 lhs, L2 qt), dgrad = nt(L1 dy, L2 q),
              wgrad = wgrad(L3 lhs, L3 dy), bf16 out)
  fp8+q       the same with the activations' quantization in the timed call (the CUDA
              quantizers of ops.fp8.quant: L1 rows, L3 grouped rows; the weight's L2 blocks
              stay pre-quantized: the layer quantizes each weight once per step for both its
              forward and its dgrad)
  fp8_f32     wgrad with float32 output (for float32 master weights)
  dense_fp8   one dense cuBLAS FP8 GEMM of the same FLOPs (jax.lax.dot_general on e4m3
              operands, contraction-major, preferred_element_type bf16; --dense-f32 adds
              dense_fp8_f32 with float32 output)

and prints a table (ms, TFLOP/s, speedup over bf16) with the issue's targets: forward >= 1.6x
our bf16 kernel at A and B, dgrad and wgrad >= 1.4x there, judged on the kernel alone (PASS /
FAIL; '-' where the issue sets no target). Timing, per point (shape, dist, op): every function
jitted and called `--warmup` times, the GPU kept busy for SPIN_UP_S, then `--reps` interleaved
rounds (one sample of each function per round, each sample at least MIN_SAMPLE_S of back-to-back
calls); a row's time is the median of its samples. (Timed one function after another, each right
after its compilation left the GPU idle, the short calls at B and C read up to 30% slow:
benchmarks/results/fp8_gemm_runs.md runs 3 and 5.) Rows are printed per point;
`--time-budget` seconds (default 140) bounds the run: points not started are reported as
skipped. The FP8 rows' error against the bf16 kernel (rel_err_vs_bf16) is measured on the
first CHECK_ROWS output rows (wgrad: the first expert). Options: --shapes A,B,C
--dists balanced,skewed --ops fwd,dgrad,wgrad --warmup 2 --reps 9 --time-budget 140
--dense-f32 --tiles auto,2,3 (the first is the fp8 row; rows fp8[<tile>] for the others;
'auto' is the tile the layer runs at that point, fp8_gemm.choose_tile)
--out PATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.grouped_gemm_cases import DISTS, OPS, SHAPES, group_sizes
from benchmarks.timing import rel_err, time_paired
from moe_praxis.ops import backend
from moe_praxis.ops.fp8 import gemm as fp8_gemm, quant as fp8_quant
import importlib

# The module (the attribute ops.grouped_gemm is the function).
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")

# (op, shape) -> the speedup of fp8 over bf16 the issue asks for
TARGETS = {(op, s): (1.6 if op == "fwd" else 1.4) for op in OPS for s in ("A", "B")}
CHECK_ROWS = 4096
_CONTRACT_1 = (((1, ), (1, )), ((), ()))  # both operands contraction-major

MIN_SAMPLE_S = 0.02  # seconds of back-to-back calls per sample
SPIN_UP_S = 0.3  # GPU work before the first round, so that its clock has settled


def time_interleaved(fns: dict, d, op: str, *, warmup: int, rounds: int):
    """({name: median seconds per call}, {name: checked slice of its output},
    {name: error text}) of fns (name -> jitted fn of d): each called `warmup` times (a failure
    is that function's error, the others go on), then the ones that ran timed together in
    interleaved rounds (benchmarks.timing.time_paired, batches of at least MIN_SAMPLE_S after
    SPIN_UP_S of GPU work)."""
    outs, errors = {}, {}
    for name, f in fns.items():
        try:
            for _ in range(max(warmup, 1)):
                out = jax.block_until_ready(f(d))
            outs[name] = _check_slice(out, op)
        except Exception as ex:  # noqa: BLE001 - one failure must not end the run
            errors[name] = repr(ex)[:300]
            traceback.print_exc()
    live = {n: fns[n] for n in fns if n in outs}
    secs = time_paired(live,
                       d,
                       target_s=0.0,
                       reps=rounds,
                       min_sample_s=MIN_SAMPLE_S,
                       spin_up_s=SPIN_UP_S)
    return secs, outs, errors


def _rows_t(x):
    return fp8_quant.quantize_rows(x, backend="auto")


def _short(config: str) -> str:
    """'coop_128x128x128_c2x1' -> 'c2x1', 'pingpong_64x128x128_c1x2' -> 'pp64c1x2',
    'coop_128x128x128_c2x1_overlap' -> 'c2x1o'."""
    kind, tile, cluster, *rest = config.split("_")
    short = cluster if kind == "coop" else f"pp{tile.split('x')[0]}{cluster}"
    return short + ("o" if rest == ["overlap"] else "")


def make_fns(op: str, m: int, k: int, n: int, e: int, dense_f32: bool = False, tiles=(0, )):
    """(the bf16 kernel's configuration, {name: jitted fn of the prepared data}) for one op;
    'fp8' runs tiles[0], 'fp8[<tile>]' each other tile of fp8_gemm.TILE_CONFIGS."""
    cfg = gg.choose_config(op, m, k, n, e)
    bf16 = {
        "fwd": lambda d: gg.cuda_fwd(d["lhs"], d["rhs"], d["gs"], cfg),
        "dgrad": lambda d: gg.cuda_dgrad(d["dout"], d["rhs"], d["gs"], cfg),
        "wgrad": lambda d: gg.cuda_wgrad(d["lhs"], d["dout"], d["gs"], cfg),
    }[op]
    if op == "wgrad":
        kern = lambda d, out=jnp.bfloat16, tile=tiles[0]: fp8_gemm.fp8_wgrad(  # noqa: E731
            *d["xt"], *d["dyt"], d["gs"], m, out_dtype=out, tile=tile)
        quant = lambda d: fp8_gemm.fp8_wgrad(  # noqa: E731
            *fp8_quant.quantize_rows_grouped_t(d["lhs"], d["gs"], backend="auto"),
            *fp8_quant.quantize_rows_grouped_t(d["dout"], d["gs"], backend="auto"),
            d["gs"],
            m,
            tile=tiles[0])
    elif op == "fwd":
        kern = lambda d, tile=tiles[0]: fp8_gemm.fp8_nt(  # noqa: E731
            *d["lhs_q"], d["qt"], d["s"], d["gs"], tile=tile)
        quant = lambda d: fp8_gemm.fp8_nt(  # noqa: E731
            *_rows_t(d["lhs"]), d["qt"], d["s"], d["gs"], tile=tiles[0])
    else:
        kern = lambda d, tile=tiles[0]: fp8_gemm.fp8_nt(  # noqa: E731
            *d["dout_q"], d["q"], d["s_t"], d["gs"], tile=tile)
        quant = lambda d: fp8_gemm.fp8_nt(  # noqa: E731
            *_rows_t(d["dout"]), d["q"], d["s_t"], d["gs"], tile=tiles[0])
    dense_args = {
        "fwd": lambda d: (d["lhs_q"][0], d["dense_w_nk"]),
        "dgrad": lambda d: (d["dout_q"][0], d["dense_w_kn"]),
        "wgrad": lambda d: (d["dense_xt"], d["dense_dyt"]),
    }[op]

    def dense(out):
        return lambda d: jax.lax.dot_general(
            *dense_args(d), _CONTRACT_1, preferred_element_type=out)

    fns = {
        "bf16": bf16,
        "fp8": kern,
    }
    for t in tiles[1:]:
        fns[f"fp8[{_short(fp8_gemm.TILE_CONFIGS[t])}]"] = lambda d, t=t: kern(d, tile=t)
    fns |= {
        "fp8+q": quant,
        "dense_fp8": dense(jnp.bfloat16),
    }
    if dense_f32:
        fns["dense_fp8_f32"] = dense(jnp.float32)
    if op == "wgrad":
        fns["fp8_f32"] = lambda d: kern(d, jnp.float32)
    return cfg, {name: jax.jit(f) for name, f in fns.items()}


def prepare(e: int, m: int, k: int, n: int, dist: str, seed: int = 0) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dout = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(group_sizes(dist, m, e))
    q, qt, s = jax.jit(lambda w: fp8_quant.quantize_weight(w, backend="auto"))(rhs)
    d = {"lhs": lhs, "rhs": rhs, "dout": dout, "gs": gs, "q": q, "qt": qt, "s": s}
    d["s_t"] = jnp.swapaxes(s, 1, 2)
    d["lhs_q"] = jax.jit(_rows_t)(lhs)
    d["dout_q"] = jax.jit(_rows_t)(dout)
    grouped = jax.jit(lambda x, g: fp8_quant.quantize_rows_grouped_t(x, g, backend="auto"))
    d["xt"] = grouped(lhs, gs)
    d["dyt"] = grouped(dout, gs)
    # dense: one [M, K] x [K, N] problem (the grouped FLOPs), operands contraction-major
    d["dense_w_nk"] = d["qt"][0]  # fwd: [N, K], one expert's weight
    d["dense_w_kn"] = q[0]  # dgrad: [K, N], contraction N
    d["dense_xt"] = jnp.swapaxes(d["lhs_q"][0], 0, 1)  # wgrad: [K, M]
    d["dense_dyt"] = jnp.swapaxes(d["dout_q"][0], 0, 1)  # [N, M]
    return jax.block_until_ready(d)


def _check_slice(out, op):
    return out[:1] if op == "wgrad" else out[:CHECK_ROWS]


def _line(r) -> str:
    if "error" in r or "skipped" in r:
        why = r.get("error") or r["skipped"]
        return f"{r['shape']:5} {r['dist']:8} {r['op']:5} {r['name']:13} {why[:90]}"
    sp = r.get("speedup_vs_bf16")
    verdict = "-" if "pass" not in r else ("PASS" if r["pass"] else "FAIL")
    err = r.get("rel_err_vs_bf16")
    return (f"{r['shape']:5} {r['dist']:8} {r['op']:5} {r['name']:13} {r['ms']:8.3f} "
            f"{r['tflops']:8.1f} {'' if sp is None else f'{sp:7.2f}':>7} "
            f"{r.get('target', '-'):>6} {verdict:>7} {'' if err is None else f'{err:8.4f}':>8}")


HEAD = (f"{'shape':5} {'dist':8} {'op':5} {'name':13} {'ms':>8} {'TFLOP/s':>8} "
        f"{'x bf16':>7} {'target':>6} {'verdict':>7} {'err/bf16':>8}")


def run(args) -> list[dict]:
    """Every point (shape, dist, op) in turn, its functions timed together
    (time_interleaved); a spent --time-budget skips the points not started."""
    rows, t_start, data = [], time.perf_counter(), {}
    print(HEAD, flush=True)
    points = [(s, dist, op) for s in args.shapes for dist in args.dists for op in args.ops]
    for shape, dist, op in points:
        e, m, k, n = SHAPES[shape]
        tiles = [fp8_gemm.choose_tile(m, e) if t == "auto" else t for t in args.tiles]
        tiles = tuple(dict.fromkeys(tiles))  # 'auto' may name a tile also listed
        cfg, fns = make_fns(op, m, k, n, e, args.dense_f32, tiles)
        secs, outs, errors = {}, {}, {}
        if time.perf_counter() - t_start > args.time_budget:
            errors = dict.fromkeys(fns, f"skipped: --time-budget {args.time_budget:g} s spent")
        else:
            if (shape, dist) not in data:
                data[(shape, dist)] = prepare(e, m, k, n, dist)
            secs, outs, errors = time_interleaved(fns,
                                                  data[(shape, dist)],
                                                  op,
                                                  warmup=args.warmup,
                                                  rounds=args.reps)
        base, ref = secs.get("bf16"), outs.get("bf16")
        flops = 2.0 * m * k * n
        for name in fns:
            row = {
                "shape": shape,
                "dist": dist,
                "op": op,
                "name": name,
                "E": e,
                "M": m,
                "K": k,
                "N": n
            }
            if name == "bf16":
                row["config"] = cfg
            elif name in ("fp8", "fp8+q", "fp8_f32"):
                row["config"] = fp8_gemm.TILE_CONFIGS[tiles[0]]
            if name in secs:
                row.update(ms=secs[name] * 1e3, tflops=flops / secs[name] / 1e12)
                if base:
                    row["speedup_vs_bf16"] = base / secs[name]
                if ref is not None and name.startswith("fp8"):
                    row["rel_err_vs_bf16"] = rel_err(outs[name], ref)
            else:
                why = errors.get(name, "not timed")
                row["skipped" if why.startswith("skipped") else "error"] = why
            target = TARGETS.get((op, shape))
            if name == "fp8" and target is not None and "ms" in row:
                row["target"] = target
                row["pass"] = bool(row.get("speedup_vs_bf16", 0.0) >= target)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def table(rows) -> str:
    return "\n".join([HEAD, "-" * len(HEAD)] + [_line(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--shapes", default="A,B,C")
    ap.add_argument("--dists", default="balanced")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--time-budget", type=float, default=140.0, help="seconds of measuring")
    ap.add_argument("--dense-f32", action="store_true", help="also dense FP8 with f32 output")
    ap.add_argument("--tiles",
                    default="auto",
                    help="FP8 tiles to time (indices of fp8_gemm.TILE_CONFIGS, or 'auto': "
                    "fp8_gemm.choose_tile's; the first is the 'fp8' row)")
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",")
    args.dists = args.dists.split(",")
    args.ops = args.ops.split(",")
    try:
        args.tiles = tuple(t if t == "auto" else int(t) for t in args.tiles.split(","))
    except ValueError:
        ap.error(f"--tiles {args.tiles!r} is invalid; valid: comma-separated integers or 'auto'")
    bad = [t for t in args.tiles if t != "auto" and t not in range(len(fp8_gemm.TILE_CONFIGS))]
    if bad:
        ap.error(f"--tiles {bad} are invalid; valid: {dict(enumerate(fp8_gemm.TILE_CONFIGS))}")
    for what, got, valid in (("shape", args.shapes, SHAPES), ("dist", args.dists, DISTS),
                             ("op", args.ops, OPS)):
        bad = [g for g in got if g not in valid]
        if bad:
            ap.error(f"--{what}s {bad} are invalid; valid: {list(valid)}")
    ok, why = backend.cuda_status(fp8_gemm.OP)
    if not ok:
        print(f"the FP8 grouped GEMM kernels cannot run here: {why}", file=sys.stderr)
        return 2
    rows = run(args)
    print("\n" + table(rows), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "device": jax.devices()[0].device_kind,
                    "host": platform.node(),
                    "jax": jax.__version__,
                    "warmup": args.warmup,
                    "reps": args.reps,
                    "rows": rows,
                },
                f,
                indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
