"""Grouped GEMM benchmark: `python -m benchmarks.bench_grouped_gemm [--out FILE.json]`.

On one GPU, times forward, dgrad and wgrad at the shapes

    A: E=8,   M=32768, K=4096, N=14336
    B: E=32,  M=32768, K=7168, N=2048
    C: E=128, M=65536, K=2048, N=768

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
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import platform
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import importlib

from benchmarks import sm80_sweep
from benchmarks.timing import rel_err, time_fn, time_paired

# The module (the attribute ops.grouped_gemm is the function).
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")
backend = importlib.import_module("moe_praxis.ops.backend")

SHAPES = {  # name: (E, M, K, N)
    "A": (8, 32768, 4096, 14336),
    "B": (32, 32768, 7168, 2048),
    "C": (128, 65536, 2048, 768),
}
DISTS = ("balanced", "skewed")
OPS = ("fwd", "dgrad", "wgrad")
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
PALLAS_CONFIGS = {
    "fwd": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (64, 256, 64, 4, 1)],
    "wgrad": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8)],
}
PALLAS_CONFIGS["dgrad"] = PALLAS_CONFIGS["fwd"]
# Our configurations timed at every point (the chosen one is timed too if not among them).
# (Swizzles 2, 4, 8 run the same kernel as 1 here: docs/grouped_gemm.md, "Raster and swizzle".)
SWEEP = [
    gg.config_name(2, 0),
    gg.config_name(2, 1),
    gg.config_name(1, 1),
    gg.config_name(1, 0),
    gg.config_name(0, 1),
    gg.config_name(3, 0),
    gg.config_name(3, 1),
    gg.config_name(4, 0),  # the adaptive pairs with 2x1 and 1x1 clusters, and their tiles
    gg.config_name(10, 0),
    gg.config_name(8, 0),
    gg.config_name(9, 0),
    gg.config_name(11, 0),  # ping-pong 128x192 with 1x1 and 2x1 clusters
    gg.config_name(12, 0),
]


def expand_config(token: str, chosen: str) -> str:
    """A --configs entry -> a configuration: `rule[/RASTER][/rROWS]` is `chosen` with those
    parts replaced; anything else is a grouped_gemm.parse_config string."""
    parts = token.split("/")
    if parts[0] != "rule":
        return gg.config_name(*gg.parse_config(token))
    tile, raster, swizzle, split = gg.parse_config(chosen)
    for part in parts[1:]:
        if part in gg.RASTERS:
            raster = gg.RASTERS.index(part)
        elif gg.parse_split(part) is not None:
            split = gg.parse_split(part)
        else:
            raise ValueError(f"--configs entry {token!r}: part {part!r} is invalid; valid: "
                             f"a raster {gg.RASTERS} or rROWS (ROWS 0 or a multiple of "
                             f"{gg.SPLIT_ROWS_MULTIPLE})")
    return gg.config_name(tile, raster, swizzle, split)


def group_sizes(dist: str, m: int, e: int) -> np.ndarray:
    """balanced: M/E each; skewed: Zipf(1.2) shares in a fixed shuffled order, summing to M."""
    if dist == "balanced":
        s = np.full(e, m // e)
        s[:m - s.sum()] += 1
    else:
        w = 1.0 / np.arange(1, e + 1)**1.2
        w = np.random.default_rng(0).permutation(w)
        s = np.floor(w / w.sum() * m).astype(np.int64)
        s[np.argmax(s)] += m - s.sum()
    return s.astype(np.int32)


def _ceil_div(x: int, q: int) -> int:
    return -(-int(x) // q)


def issued_tiles(config: str, op: str, sizes, k: int, n: int) -> int | None:
    """CTA tiles that CUTLASS's group scheduler issues for `config` (each group's tile grid
    rounded up to whole clusters, gg.CLUSTERS, as kernels/grouped_gemm.cuh counts them); None
    for the adaptive pairs (the device picks their tile at each call)."""
    tile = gg.parse_config(config)[0]
    m = re.match(r"(?:coop|pingpong)_(\d+)x(\d+)_", gg.TILE_CONFIGS[tile])
    if m is None:
        return None
    tm, tn = (int(v) for v in m.groups())
    cm, cn = gg.CLUSTERS[tile]
    rows_cols = {
        "fwd": [(s, n) for s in sizes],
        "dgrad": [(s, k) for s in sizes],
        "wgrad": [(k, n) for s in sizes if s > 0],
    }[op]
    return sum(
        _ceil_div(_ceil_div(r, tm), cm) * cm * _ceil_div(_ceil_div(c, tn), cn) * cn
        for r, c in rows_cols if r > 0)


def dense_fns():
    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(lhs, rhs[0])),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(dout, rhs[0].T)),
        "wgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(lhs.T, dout)),
    }


def batched_fns(e: int):
    """The balanced problem as one batched cuBLAS GEMM (every group M/E rows): the same
    FLOPs and the same E weight matrices as ours, so the same weight traffic, which the dense
    GEMM (one [K, N] weight) does not have. Only for balanced groups with E dividing M."""

    def rows(x):
        return x.reshape(e, x.shape[0] // e, x.shape[1])

    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emk,ekn->emn", rows(lhs), rhs)),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emn,ekn->emk", rows(dout), rhs)),
        "wgrad":
        jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emk,emn->ekn", rows(lhs), rows(dout))),
    }


def ragged_fns():
    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_reference(lhs, rhs, gs)),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_dgrad_reference(dout, rhs, gs)),
        "wgrad": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_wgrad_reference(lhs, dout, gs)),
    }


def ours_fn(op: str, config: str):
    f = {
        "fwd": lambda lhs, rhs, dout, gs: gg.cuda_fwd(lhs, rhs, gs, config),
        "dgrad": lambda lhs, rhs, dout, gs: gg.cuda_dgrad(dout, rhs, gs, config),
        "wgrad": lambda lhs, rhs, dout, gs: gg.cuda_wgrad(lhs, dout, gs, config)
    }[op]
    return jax.jit(f)


def sm80_fn(op: str, config: str):
    """The sm_80 kernel of `op` with `config` (an SM80_TILE_CONFIGS name), jitted."""
    f = {
        "fwd":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("fwd", (lhs.shape[0], rhs.shape[2]), lhs, rhs,
                                                      gs, config),
        "dgrad":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("dgrad", (dout.shape[0], rhs.shape[1]), dout,
                                                      rhs, gs, config),
        "wgrad":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("wgrad", rhs.shape, lhs, dout, gs, config),
    }[op]
    return jax.jit(f)


def pallas_fn(op: str, cfg):
    bm, bn, bk, steps, gbn = cfg
    kw = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)
    if op == "wgrad":
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t

        return jax.jit(
            lambda lhs, rhs, dout, gs: t.transposed_ragged_dot(lhs, dout, group_sizes=gs, **kw))
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as r

    if op == "fwd":
        return jax.jit(lambda lhs, rhs, dout, gs: r.ragged_dot(lhs, rhs, group_sizes=gs, **kw))
    return jax.jit(lambda lhs, rhs, dout, gs: r.ragged_dot(
        dout, rhs, group_sizes=gs, transpose_rhs=True, **kw))


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


def parse_sm80_tiles(text: str):
    """--sm80-tiles: 'all' -> every SM80_TILE_CONFIGS name, 'rule' -> 'rule', else the
    comma-separated configurations (ValueError naming the valid ones)."""
    if text == "rule":
        return "rule"
    if text == "all":
        return list(gg.SM80_TILE_CONFIGS)
    return [gg.SM80_TILE_CONFIGS[gg.parse_sm80_config(c)] for c in text.split(",") if c]


def sm80_one_group_fn(op: str, config: str):
    """The sm_80 kernel of `op` with `config` on ONE group of all the rows against expert 0's
    weight: the FLOPs of the dense GEMM through the same tile and code (mma.sync), so the gap
    from it to the grouped call is what the grouping costs, and the gap from it to dense cuBLAS
    what the Ampere instructions cost on this GPU. (The slice of the weight is a copy of one
    expert's weight inside the call, well under 1% of these GEMMs' time.)"""
    base = sm80_fn(op, config)

    def f(lhs, rhs, dout, gs):
        del gs
        return base(lhs, rhs[:1], dout, jnp.full((1, ), lhs.shape[0], jnp.int32))

    return jax.jit(f)


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


def sm80_summary(rows) -> str:
    """One line per (shape, dist, op) with an sm80 row: the sm_80 kernels (the rule's tile, and
    the best tile timed) against dense cuBLAS, ragged_dot and ours (the Hopper kernels); speed
    ratios, > 1 means the sm_80 kernel is faster."""
    out = [
        "| shape | groups | op | dense | ragged_dot | ours (Hopper) | sm80 (config) "
        "| sm80 / dense | sm80 / ragged_dot | sm80 / ours | best sm80 tile | sm80, 1 group "
        "| sm80 / 1 group |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    keys = list(dict.fromkeys((r["shape"], r["dist"], r["op"]) for r in rows))
    for key in keys:
        get = {r["method"]: r for r in rows if (r["shape"], r["dist"], r["op"]) == key}
        s = get.get("sm80")
        if s is None:
            continue
        tiles = [r for name, r in get.items() if name == "sm80" or name.startswith("sm80[")]
        best = min(tiles, key=lambda r: r["ms"])

        def cell(r):
            return f"{r['ms']:.3f} ms, {r['tflops']:.0f}" if r else "-"

        def ratio(x):
            return f"{x['ms'] / s['ms']:.2f}" if x else "-"

        d, rg, o = get.get("dense"), get.get("ragged"), get.get("ours")
        one = get.get("sm80_1group")
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell(d)} | {cell(rg)} | {cell(o)} | "
                   f"{cell(s)} ({s['config']}) | {ratio(d)} | {ratio(rg)} | {ratio(o)} | "
                   f"{best['config']} ({best['tflops']:.0f}) | {cell(one)} | {ratio(one)} |")
    return "\n".join(out)


def summary_table(rows, skipped=()) -> str:
    """One line per (shape, dist, op): ms and TFLOP/s of each method, ours / dense, ours / pallas
    (speed ratios: > 1 means ours is faster). Dense, ours and Pallas are timed interleaved at
    each point (time_paired); dense is the same GEMM for both distributions."""
    dense = {(r["shape"], r["dist"], r["op"]): r for r in rows if r["method"] == "dense"}
    out = [
        "| shape | groups | op | dense | ragged_dot | Pallas (config) | ours (config) "
        "| ours / dense | ours / Pallas | ours: tiles, waves | batched | ours / batched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    keys = []
    for r in rows:
        if (r["shape"], r["dist"], r["op"]) not in keys:
            keys.append((r["shape"], r["dist"], r["op"]))

    def cell(r, method=""):
        if r:
            return f"{r['ms']:.3f} ms, {r['tflops']:.0f}"
        return "(skipped)" if method in skipped else "failed"

    for shape, dist, op in keys:
        get = {
            r["method"]: r
            for r in rows if (r["shape"], r["dist"], r["op"]) == (shape, dist, op)
        }
        d, o, p = dense.get((shape, dist, op)), get.get("ours"), get.get("pallas")
        pc = f" ({','.join(map(str, p['config']))})" if p else ""
        oc = f" ({o['config']})" if o else ""
        b = get.get("batched")  # balanced points only

        def ratio(x):  # ours' speed relative to x (> 1: ours faster)
            return f"{x['ms'] / o['ms']:.2f}" if x and o else "-"

        tw = f"{o['tiles']}, {o['waves']:.2f}" if o and o.get("waves") else "-"
        out.append(f"| {shape} | {dist} | {op} | {cell(d)} | {cell(get.get('ragged'), 'ragged')} | "
                   f"{cell(p, 'pallas')}{pc} | {cell(o)}{oc} | {ratio(d)} | {ratio(p)} | {tw} | "
                   f"{cell(b) if b else '-'} | {ratio(b)} |")
    return "\n".join(out)


def print_table(rows):
    dense = {(r["shape"], r["dist"], r["op"]): r["ms"] for r in rows if r["method"] == "dense"}
    print("\n| shape | dist | op | method | ms | TFLOP/s | x dense |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["method"].startswith("ours["):
            continue
        d = dense.get((r["shape"], r["dist"], r["op"]))
        ratio = f"{d / r['ms']:.2f}" if d else "-"
        print(f"| {r['shape']} | {r['dist']} | {r['op']} | {r['method']} | {r['ms']:.3f} | "
              f"{r['tflops']:.0f} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
