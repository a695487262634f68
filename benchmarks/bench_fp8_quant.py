"""FP8 quantization kernel benchmark: `python -m benchmarks.bench_fp8_quant [--out FILE.json]`.

Times each kernel of kernels/fp8_quant.cu and fp8_quant_tiles.cu against its pure-JAX reference
(jitted, XLA) on one GPU, bf16 inputs at the Mixtral-like expert shapes (rows R = --rows, width
--width, hidden --hidden, --experts groups), and prints a table: time per call, achieved bandwidth
(the fewest bytes the op must move: inputs read once, outputs written once) as a fraction of the
copy bandwidth measured here (bench_kernels.copy_bandwidth), and the speedup over XLA. Each row also
says whether the kernel's outputs equal the reference's bitwise (tests/test_fp8_quant_gpu.py is the
real check; swiglu_fp8's are not expected to: its activation is the SwiGLU kernel's). Writes the
numbers as JSON.

Timing: one jitted function applies the op to `n` independent input sets (distinct buffers),
warmed up, called `reps` times; the median wall time divided by n.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_kernels import copy_bandwidth
from moe_praxis import ops
from moe_praxis.ops.fp8 import fused as fp8_fused, quant as fp8_quant


def _seconds(fn, inputs, reps):
    f = jax.jit(lambda ins: [fn(*i) for i in ins])
    jax.block_until_ready(f(inputs))
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(f(inputs))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) / len(inputs)


def cases(rows, width, hidden, experts, tokens):
    """name -> (bytes moved, make(n) -> input sets, ours, reference)."""
    bf = jnp.bfloat16

    def normal(shape, i):
        return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(bf)

    def sizes(i):
        cuts = np.sort(np.random.default_rng(i).integers(0, rows, experts - 1))
        return jnp.asarray(np.diff(np.concatenate([[0], cuts, [rows]])), jnp.int32)

    rp = fp8_quant.padded_rows(rows, experts)
    el, wel, hel = rows * width, experts * width * hidden, rows * hidden
    cuda = dict(backend="cuda")
    return {
        "quantize_rows (L1)":
        (el * 3 + el // 32, lambda n: [(normal((rows, width), i), ) for i in range(n)],
         functools.partial(fp8_quant.quantize_rows, **cuda), fp8_quant.quantize_rows_reference),
        "quantize_weight (L2)": (wel * 4 + wel // 4096, lambda n: [(normal(
            (experts, width, hidden), i), ) for i in range(n)],
                                 functools.partial(fp8_quant.quantize_weight,
                                                   **cuda), fp8_quant.quantize_weight_reference),
        "quantize_rows_grouped_t (L3)":
        (el * 2 + rp * width + rp * width // 32, lambda n: [(normal((rows, width), i), sizes(i))
                                                            for i in range(n)],
         functools.partial(fp8_quant.quantize_rows_grouped_t,
                           **cuda), fp8_quant.quantize_rows_grouped_t_reference),
        "swiglu_fp8": (hel * 7 + hel // 32, lambda n: [(normal(
            (rows, hidden), 2 * i), normal((rows, hidden), 2 * i + 1)) for i in range(n)],
                       functools.partial(fp8_fused.swiglu_fp8,
                                         **cuda), fp8_fused.swiglu_fp8_reference),
        "permute_fp8": (el * 5 + el // 32, lambda n: [(normal(
            (tokens, width), i), jax.random.randint(jax.random.key(i), (rows, ), 0, tokens))
                                                      for i in range(n)],
                        functools.partial(fp8_fused.permute_fp8,
                                          **cuda), fp8_fused.permute_fp8_reference),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32768, help="rows R (token copies)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens T of the permute")
    ap.add_argument("--width", type=int, default=4096, help="row width (d_model)")
    ap.add_argument("--hidden", type=int, default=14336, help="expert hidden width (d_ff)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--n", type=int, default=4, help="input sets per timed call")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--out", default="runs/bench_fp8_quant.json")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    info = ops.backend_info()["cuda"]
    if not info["usable"]:
        print(f"bench_fp8_quant: CUDA kernels not usable: {info['reason']}", file=sys.stderr)
        return 1
    copy_bw = copy_bandwidth(args.reps)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "copy_bw_measured": copy_bw,
        **{
            k: getattr(args, k)
            for k in ("rows", "tokens", "width", "hidden", "experts")
        },
    }
    print(f"# {meta['date']} {meta['device']} jax {meta['jax']}; copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'kernel':32s} {'ours us':>9s} {'xla us':>9s} {'TB/s':>6s} {'of copy':>7s} "
          f"{'speedup':>7s} bitwise")
    rows = []
    todo = cases(args.rows, args.width, args.hidden, args.experts, args.tokens)
    for name, (nbytes, make, ours, ref) in todo.items():
        if args.only and name.split(" ")[0] not in args.only.split(","):
            continue
        inputs = make(args.n)
        got, want = jax.jit(ours)(*inputs[0]), jax.jit(ref)(*inputs[0])
        same = all(
            np.array_equal(np.asarray(a).view(np.uint8),
                           np.asarray(b).view(np.uint8))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        t_ours, t_xla = _seconds(ours, inputs, args.reps), _seconds(ref, inputs, args.reps)
        del inputs
        row = {
            "kernel": name,
            "bytes": nbytes,
            "ours_us": t_ours * 1e6,
            "xla_us": t_xla * 1e6,
            "ours_TBps": nbytes / t_ours / 1e12,
            "ours_frac_copy": nbytes / t_ours / copy_bw,
            "speedup": t_xla / t_ours,
            "bitwise_equal_to_reference": same,
        }
        rows.append(row)
        print(f"{name:32s} {row['ours_us']:9.1f} {row['xla_us']:9.1f} {row['ours_TBps']:6.2f} "
              f"{row['ours_frac_copy']:7.0%} {row['speedup']:7.2f} {same}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
