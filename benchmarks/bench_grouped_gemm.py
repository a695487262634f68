"""Grouped GEMM benchmark: `python -m benchmarks.bench_grouped_gemm [--out FILE.json]`.

On one GPU, times forward, dgrad and wgrad at the shapes

    A: E=8,   M=32768, K=4096, N=14336
    B: E=32,  M=32768, K=7168, N=2048
    C: E=128, M=65536, K=2048, N=768

(and, by --shapes only, A4 / A4t / At / C2: A at 4x the rows, its down projection at 4x and 1x,
and C at the Qwen3-like layer's 1024 rows per group; benchmarks/grouped_gemm_cases.py)
with balanced and skewed group sizes (both sum to M, so every method does 2*M*K*N FLOPs), for

  dense   one cuBLAS GEMM of equal FLOPs (jnp.dot: [M,K]x[K,N], [M,N]x[N,K], [K,M]x[M,N])
  ragged  jax.lax.ragged_dot (fwd, dgrad) / jax.lax.ragged_dot_general (wgrad), as jax.grad
  pallas  Pallas Mosaic-GPU ragged_dot_mgpu.ragged_dot (fwd; dgrad with transpose_rhs=True)
          and transposed_ragged_dot_mgpu.transposed_ragged_dot (wgrad), best of a small
          tile sweep (PALLAS_CONFIGS, swept on the balanced case, reused for skewed)
  batched the balanced case as one batched cuBLAS GEMM (jnp.einsum over [E, M/E, K] rows;
          balanced groups only): the same weight traffic as ours (E distinct [K, N] weights),
          which the dense GEMM does not have
  ours    moe_praxis CUTLASS kernels, configuration chosen by grouped_gemm.choose_config;
          the configurations in SWEEP are timed too (ours[<config>]).
  sm80    (--sm80) moe_praxis's sm_80 kernels (CUTLASS 2.x GemmGrouped, mma.sync), called
          directly whatever the GPU: the tile choose_sm80_config picks ('sm80') and the tiles
          of --sm80-tiles ('sm80[<config>]'), all timed interleaved with dense and ours; a
          second summary prints sm80 / dense, / ragged_dot, / ours, and the sweep table every
          tile's TFLOP/s and the per-shape rankings as the rule's table (benchmarks/sm80_sweep:
          SM80_MEASURED, printed ready to paste and written to the JSON as sm80_winners);
          'sm80_1group': the rule's tile on one group of all the rows (the dense GEMM's FLOPs
          through the same mma.sync code: the ceiling of the grouped call on this GPU).

Prints a table (ms, TFLOP/s, ratio to dense; for ours also the CTA tiles the group scheduler
issues and the waves they make on this GPU's SMs, `issued_tiles`) and writes JSON. Timing:
each function is jitted, warmed up, then called `iters` times back to back (async dispatch)
between two block_until_ready; the median over `reps` such batches, divided by iters. At each
point the compared rows (dense, ours with the chosen configuration, Pallas with its best
configuration) are timed in interleaved batches (`time_paired`): a clock drift during the run
moves them alike. (Until 2026-11-30 dense was timed once per shape and op, first.)
Options: --shapes A,B,C  --dists balanced,skewed  --ops fwd,dgrad,wgrad
--skip ragged,pallas,tiles,batched,ours (ours: the Hopper kernels, e.g. on an A100)
--sm80 (time the sm_80 kernels too)  --sm80-tiles all|rule|LIST (which sm_80 tiles: every tile
of SM80_TILE_CONFIGS, the rule's only, or the comma-separated configurations; unset: all, or the
rule's only with --skip tiles, so `--skip tiles --sm80-tiles all` sweeps the sm_80 tiles beside
the Hopper kernel's chosen configuration alone)
--time-budget SECONDS (stop measuring, still print and write, when exceeded)
--configs LIST (comma-separated, instead of SWEEP: configurations, or `rule` = the chosen
configuration, optionally with parts replaced, e.g. `rule/r2048` (its row split set to 2048),
`rule/along_n`, `rule/along_n/r0`; see `expand_config`).
--pair-configs: time the swept configurations in the same interleaved batches as dense, ours
and Pallas (instead of each alone, before them), so that configurations are compared under the
same clocks; the chosen configuration then appears twice (`ours[<config>]` and `ours`), which
shows the spread of one kernel within a run.

The shapes, configurations and timed functions are in benchmarks/grouped_gemm_cases.py, the
tables in benchmarks/grouped_gemm_report.py.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import importlib

from benchmarks import sm80_sweep
from benchmarks.grouped_gemm_cases import (DISTS, OPS, PALLAS_CONFIGS, SHAPES, SWEEP, batched_fns,
                                           dense_fns, expand_config, group_sizes, issued_tiles,
                                           ours_fn, pallas_fn, parse_sm80_tiles, ragged_fns,
                                           sm80_fn, sm80_one_group_fn)
from benchmarks.grouped_gemm_report import print_table, sm80_summary, summary_table
from benchmarks.timing import rel_err, time_fn, time_paired

# The module (the attribute ops.grouped_gemm is the function).
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")
backend = importlib.import_module("moe_praxis.ops.backend")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_grouped_gemm")
    ap.add_argument("--out", default="bench_grouped_gemm.json")
    ap.add_argument("--shapes", default="A,B,C")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--skip",
                    default="",
                    help="comma-separated: ragged, pallas, tiles, batched, ours")
    ap.add_argument("--sm80",
                    action="store_true",
                    help="time the sm_80 kernels (every tile, the rule's interleaved) too")
    ap.add_argument("--sm80-tiles",
                    default=None,
                    help="with --sm80: all, rule, or comma-separated sm_80 configurations "
                    "(default: all; rule with --skip tiles)")
    ap.add_argument("--time-budget", type=float, default=1e9)
    ap.add_argument("--configs", default="", help="comma-separated, instead of SWEEP (see doc)")
    ap.add_argument("--pair-configs",
                    action="store_true",
                    help="time the swept configurations interleaved with dense and ours")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    sm80_tiles = parse_sm80_tiles(args.sm80_tiles or ("rule" if "tiles" in skip else "all"))
    t_start = time.time()
    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.device_kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        "python": platform.python_version(),
        "tile_configs": list(gg.TILE_CONFIGS),
        "sm80_tile_configs": list(gg.SM80_TILE_CONFIGS),
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    # SMs: the persistent kernels' CTAs (one per SM); waves = issued tiles / SMs
    sms = backend.sm_count()
    meta["sm_count"] = sms
    print(json.dumps(meta), flush=True)
    rows, errors = [], []
    pallas_best: dict = {}

    def record(shape, dist, op, method, secs, flops, extra=None):
        row = dict(shape=shape,
                   dist=dist,
                   op=op,
                   method=method,
                   ms=secs * 1e3,
                   tflops=flops / secs / 1e12,
                   **(extra or {}))
        rows.append(row)
        print(
            f"  {shape} {dist:8s} {op:5s} {method:28s} {row['ms']:9.3f} ms "
            f"{row['tflops']:7.1f} TFLOP/s",
            flush=True)

    def over_budget():
        return time.time() - t_start > args.time_budget

    dense = dense_fns()
    ragged = ragged_fns()
    for shape in args.shapes.split(","):
        e, m, k, n = SHAPES[shape]
        flops = 2.0 * m * k * n
        key = jax.random.key(0)
        k1, k2, k3 = jax.random.split(key, 3)
        lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
        rhs = (jax.random.normal(k2, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        dout = jax.random.normal(k3, (m, n), jnp.bfloat16)
        batched = batched_fns(e)  # jitted once per shape, like dense and ragged
        ref = out = data = None
        for dist in args.dists.split(","):
            gs = jnp.asarray(group_sizes(dist, m, e))
            data = (lhs, rhs, dout, gs)
            for op in args.ops.split(","):
                if over_budget():
                    break
                # dense, ours (the chosen configuration) and Pallas (its best configuration) are
                # the rows the summary compares: timed interleaved at every point (time_paired)
                paired = {"dense": dense[op]}
                paired_extra: dict = {"dense": {}}
                if "batched" not in skip and dist == "balanced" and m % e == 0:
                    paired["batched"] = batched[op]
                    paired_extra["batched"] = {}
                ref = None
                if "ragged" not in skip:
                    try:
                        ref = jax.block_until_ready(ragged[op](*data))
                        record(shape, dist, op, "ragged", time_fn(ragged[op], *data, reps=3), flops)
                    except Exception as ex:  # noqa: BLE001
                        errors.append(f"{shape} {dist} {op} ragged: {ex!r}")
                        print("  ragged failed:", repr(ex)[:300], flush=True)
                chosen = gg.choose_config(op, m, k, n, e)
                configs = [chosen] if "tiles" in skip else SWEEP
                if "ours" in skip:
                    configs = []
                if args.configs:
                    configs = list(
                        dict.fromkeys(expand_config(t, chosen) for t in args.configs.split(",")))
                if chosen not in configs and "ours" not in skip:
                    configs = configs + [chosen]
                for c in configs:
                    try:
                        f = ours_fn(op, c)
                        out = f(*data)
                        err = rel_err(out, ref) if ref is not None else None
                        tiles = issued_tiles(c, op, np.asarray(gs), k, n)
                        extra = {
                            "rel_err_vs_ragged": err,
                            "config": c,
                            "tiles": tiles,
                            "waves": tiles / sms if tiles and sms else None
                        }
                        if args.pair_configs:  # timed below, interleaved with dense and ours
                            paired[f"ours[{c}]"], paired_extra[f"ours[{c}]"] = f, extra
                        else:
                            record(shape, dist, op, f"ours[{c}]", time_fn(f, *data), flops, extra)
                        if c == chosen:
                            paired["ours"], paired_extra["ours"] = f, extra
                    except Exception as ex:  # noqa: BLE001
                        errors.append(f"{shape} {dist} {op} ours {c}: {ex!r}")
                        print("  ours failed:", repr(ex)[:500], flush=True)
                if args.sm80:
                    time_sm80(op, (m, k, n, e), data, ref, sm80_tiles, paired, paired_extra, errors)
                out = None
                if "pallas" not in skip:
                    bkey = (shape, op)
                    cfgs = [pallas_best[bkey]] if bkey in pallas_best else PALLAS_CONFIGS[op]
                    best = None
                    for cfg in cfgs:
                        try:
                            f = pallas_fn(op, cfg)
                            secs = time_fn(f, *data, reps=3)
                            print(f"    pallas {op} {cfg}: {secs * 1e3:.3f} ms", flush=True)
                            if best is None or secs < best[0]:
                                best = (secs, cfg, f)
                        except Exception as ex:  # noqa: BLE001
                            msg = f"{shape} {dist} {op} pallas {cfg}: {type(ex).__name__}: {ex}"
                            errors.append(msg[:600])
                            print("    " + msg[:300], flush=True)
                    if best is not None:
                        pallas_best[bkey] = best[1]
                        out = best[2](*data)
                        paired["pallas"] = best[2]
                        paired_extra["pallas"] = {
                            "config": list(best[1]),
                            "rel_err_vs_ragged": rel_err(out, ref) if ref is not None else None
                        }
                        out = None
                try:
                    secs = time_paired(paired, *data)
                    for name in paired:
                        record(shape, dist, op, name, secs[name], flops, paired_extra[name])
                except Exception as ex:  # noqa: BLE001
                    errors.append(f"{shape} {dist} {op} paired timing: {ex!r}")
                    print("  paired timing failed:", repr(ex)[:500], flush=True)
            with open(args.out, "w") as fh:
                json.dump({"meta": meta, "rows": rows, "errors": errors}, fh, indent=1)
        del lhs, rhs, dout, data, gs, ref, out
        gc.collect()
    print_table(rows)
    print("\n" + summary_table(rows, skip))
    result = {"meta": meta, "rows": rows, "errors": errors}
    if args.sm80:
        print("\n" + sm80_summary(rows))
        timed = {r.get("config") for r in rows if r["method"].split("[")[0] == "sm80"}
        configs = [c for c in gg.SM80_TILE_CONFIGS if c in timed]
        print("\n" + sm80_sweep.sweep_table(rows, configs))
        result["sm80_winners"] = sm80_sweep.winners(rows, SHAPES)
        print("\n" + sm80_sweep.winners_literal(result["sm80_winners"]))
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out} ({len(rows)} rows, {len(errors)} errors) in "
          f"{time.time() - t_start:.0f} s")
    return 0


def time_sm80(op, dims, data, ref, tiles, paired, paired_extra, errors):
    """The sm_80 kernels at one point, all added to `paired` (timed interleaved with dense and
    ours): the rule's tile as 'sm80', every other tile of `tiles` (parse_sm80_tiles) as
    'sm80[<config>]'."""
    m, k, n, e = dims
    chosen = gg.choose_sm80_config(op, m, k, n, e, backend.shared_memory_per_block())
    for c in [chosen] + ([] if tiles == "rule" else [t for t in tiles if t != chosen]):
        try:
            f = sm80_fn(op, c)
            out = f(*data)
            extra = {"rel_err_vs_ragged": rel_err(out, ref) if ref is not None else None}
            extra["config"] = c
            del out
            name = "sm80" if c == chosen else f"sm80[{c}]"
            paired[name], paired_extra[name] = f, extra
        except Exception as ex:  # noqa: BLE001
            errors.append(f"{op} sm80 {c}: {ex!r}")
            print("  sm80 failed:", repr(ex)[:500], flush=True)
    try:
        f = sm80_one_group_fn(op, chosen)
        jax.block_until_ready(f(*data))
        paired["sm80_1group"], paired_extra["sm80_1group"] = f, {"config": chosen}
    except Exception as ex:  # noqa: BLE001
        errors.append(f"{op} sm80_1group {chosen}: {ex!r}")
        print("  sm80_1group failed:", repr(ex)[:500], flush=True)


if __name__ == "__main__":
    sys.exit(main())
