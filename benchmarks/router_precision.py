"""The router GEMM's precision against float32: `python -m
benchmarks.router_precision [--shapes qwen3,deepseek_ep4,mixtral] [--quick] [--no-block]
[--json PATH]`.

For each shape of benchmarks.layer_cases (bf16 x, a float32 router of float32 values, the shape's
routing)
and each router_precision ('float32', 'bf16x3' = the GPU's 'auto', 'tf32', 'bf16'):
  logits err    ||logits - x @ w (float64)|| / ||x @ w (float64)||
  changed       share of float32's (token, expert) choices this precision does not make
  max dw        largest |routing weight - float32's| over the tokens whose choices agree
  y err, aux, z (unless --no-block) moe_block's forward (kernel_backend 'auto', z_loss_coeff 1e-3): ||y - y32|| /
                ||y32||, and the aux and z losses' relative distance from float32's
  ms            the router GEMM forward + backward alone (jit(vjp) of x @ w: dx and dw), median
Prints a table, writes JSON (default benchmarks/results/router_precision.json). --quick: the CPU
sizes (layer_cases.QUICK_SHAPES): the smoke test (tests/test_split_dot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis as mp
from benchmarks import layer_cases as lc
from benchmarks.timing import time_fn
from moe_praxis import routing
from moe_praxis.ops import router as router_op

PRECISIONS = ("float32", "bf16x3", "tf32", "bf16")
DEFAULT_JSON = "benchmarks/results/router_precision.json"


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def changed_choices(ids, ref_ids, e: int) -> float:
    """Share of the reference's (token, expert) choices that `ids` does not make."""
    a = np.zeros((ids.shape[0], e), bool)
    b = np.zeros_like(a)
    np.put_along_axis(a, np.asarray(ids), True, axis=1)
    np.put_along_axis(b, np.asarray(ref_ids), True, axis=1)
    return float(np.sum(b & ~a) / b.sum())


def measure(name: str, shape: lc.Shape, reps: int, target_s: float, block: bool) -> list[dict]:
    kp, kx, kc, kw = jax.random.split(jax.random.key(0), 4)
    params = lc.make_params(shape, kp)
    x = jax.random.normal(kx, (shape.t, shape.m), jnp.bfloat16)
    cot = jax.random.normal(kc, (shape.t, shape.e), jnp.float32)
    # a float32 router with float32 values (make_params' router holds bf16 values: every
    # precision would be exact on it)
    w = jax.random.normal(kw, (shape.m, shape.e), jnp.float32) / np.sqrt(shape.m)
    params["router"] = w
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    out, rows = {}, []
    for prec in PRECISIONS:
        cfg = lc.config(shape, router_precision=prec, z_loss_coeff=1e-3)
        r = jax.jit(lambda x, w, b: routing.route(x, w, cfg, b))(x, w, params.get("expert_bias"))
        blk = jax.jit(lambda p, x: mp.moe_block(p, x, cfg))(params, x) if block else None
        gemm = jax.jit(lambda x, w: jax.vjp(
            lambda a, b: router_op.router_gemm(a, b, precision=prec), x, w)[1](cot))
        secs = time_fn(lambda: gemm(x, w), target_s=target_s, reps=reps)
        out[prec] = (r, blk)
        r32, b32 = out["float32"]
        ids, ids32 = np.asarray(r.expert_ids), np.asarray(r32.expert_ids)
        same = np.all(np.sort(ids, 1) == np.sort(ids32, 1), axis=1)
        dw = np.abs(np.sort(np.asarray(r.weights), 1) - np.sort(np.asarray(r32.weights), 1))
        rows.append(
            dict(shape=name,
                 precision=prec,
                 logits_err=_rel(r.logits, ref),
                 changed=changed_choices(ids, ids32, shape.e),
                 max_weight_diff=float(dw[same].max()) if same.any() else None,
                 **(_block_diffs(blk, b32) if block else {}),
                 gemm_fwd_bwd_ms=secs * 1e3))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _block_diffs(blk, b32) -> dict:
    rel = lambda a, b: abs(float(a) - float(b)) / abs(float(b))
    return dict(y_err=_rel(blk.y, b32.y),
                aux_rel=rel(blk.aux_loss, b32.aux_loss),
                z_rel=rel(blk.z_loss, b32.z_loss))


def table(rows: list[dict]) -> str:
    out = [
        "| shape | precision | logits err | changed choices | max weight diff | y err | aux rel "
        "| z rel | router GEMM fwd+bwd ms |", "|" + "---|" * 9
    ]
    for r in rows:
        e = lambda k: "-" if r.get(k) is None else f"{r[k]:.1e}"
        out.append(f"| {r['shape']} | {r['precision']} | {e('logits_err')} | "
                   f"{100 * r['changed']:.3f}% | {e('max_weight_diff')} | {e('y_err')} | "
                   f"{e('aux_rel')} | {e('z_rel')} | {r['gemm_fwd_bwd_ms']:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.router_precision")
    ap.add_argument("--shapes", default="qwen3,deepseek_ep4,mixtral")
    ap.add_argument("--quick", action="store_true", help="CPU sizes, 1 round")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--block",
                    action=argparse.BooleanOptionalAction,
                    default=True,
                    help="also run moe_block forward per precision (y, aux and z losses)")
    opts = ap.parse_args(argv)
    shapes = lc.QUICK_SHAPES if opts.quick else lc.SHAPES
    names = [s for s in opts.shapes.split(",") if s]
    bad = [s for s in names if s not in shapes]
    if bad or not names:
        ap.error(f"--shapes {bad or opts.shapes!r} invalid; valid: {', '.join(shapes)}")
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind,
                platform=dev.platform,
                jax=jax.__version__,
                quick=opts.quick)
    rows = []
    for n in names:
        rows += measure(n, shapes[n], 1 if opts.quick else 7, 0.01 if opts.quick else 0.25,
                        opts.block)
    print("\n" + table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
    with open(opts.json, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
