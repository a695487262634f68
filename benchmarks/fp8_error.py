"""How far the FP8 forward moves the MoE block's output, weight by weight: `python -m
benchmarks.fp8_error [--d_model 512] [--d_ff 1792] [--experts 8] [--top_k 2] [--tokens 2048]
[--seed 0] [--backend xla|cuda] [--json PATH]`.

One moe_block forward (kernel_backend 'xla': on a CPU the pure-JAX FP8 recipe, the kernels'
arithmetic up to summation order; on a GPU the same emulation, so machines compare) of Gaussian
tokens through freshly initialised experts:
  float32     float32 tokens and weights: the reference
  bf16        bf16 tokens and weights, fp8 None
  fp8 MODE    bf16 tokens and weights, fp8 'blockwise' with fp8_gemms MODE: 'fwd' (every
              forward in FP8), 'wi=fwd' (the gate and up projections'), 'wo=fwd' (the down
              projection's)
and for each ||y - y_float32|| / ||y_float32|| and ||y - y_bf16|| / ||y_bf16|| (the routing is
the same in all of them but bf16 against float32, where rounded logits move some top-k
choices). `--backend cuda` (a GPU with the kernel library) runs the bf16 and FP8 rows on the CUDA
kernels instead and adds each one's distance from the same format in the pure-JAX recipe
(`vs_emulation`: the same quantized operands, so what is left is the kernels' accumulation and
summation order; the float32 reference is XLA's at HIGHEST precision either way). Beside them
the rounding the recipe starts from: e4m3 with one scale per 1x128 block
(ops.fp8.quant.quantize_tiles) on Gaussian values, element-wise, and for a product of two
such operands.
Prints a table, writes JSON (default benchmarks/results/fp8_error.json). Measures numerics,
not speed: it runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import warnings

import jax
import jax.numpy as jnp

import moe_praxis as mp
from benchmarks.timing import rel_err
from moe_praxis.ops import backend as kernels
from moe_praxis.ops.fp8 import quant as fp8_quant

MODES = ("fwd", "wi=fwd", "wo=fwd")
DEFAULT_JSON = "benchmarks/results/fp8_error.json"
BLOCK = fp8_quant.BLOCK


def e4m3_rounding(rows: int, cols: int, seed: int) -> tuple[float, float]:
    """(element-wise, product) relative error of the recipe's 1x128 tile quantization
    (ops.fp8.quant.quantize_tiles: e4m3, one scale per tile) of Gaussian values: ||q(a) - a|| /
    ||a||, and ||q(a) q(b) - a b|| / ||a b|| of a [rows, cols] x [cols, cols] product (both
    operands tiled along the contraction)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (rows, cols), jnp.float32)
    b = jax.random.normal(kb, (cols, cols), jnp.float32)

    def q(v, axis):
        return fp8_quant.dequantize_tiles(*fp8_quant.quantize_tiles(v, axis), axis)

    exact = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    rounded = jnp.dot(q(a, 1), q(b, 0), precision=jax.lax.Precision.HIGHEST)
    return rel_err(q(a, 1), a), rel_err(rounded, exact)


def measure(d_model: int,
            d_ff: int,
            experts: int,
            top_k: int,
            tokens: int,
            seed: int,
            backend: str = "xla") -> dict:
    """{name: {'vs_float32', 'vs_bf16'[, 'vs_emulation']}} of the block's output under each
    format (module doc); backend: the kernel_backend of the bf16 and FP8 rows."""
    base = dict(d_model=d_model, d_ff=d_ff, num_experts=experts, top_k=top_k)
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, mp.MoEConfig(**base))
    x = jax.random.normal(k2, (1, tokens, d_model), jnp.float32)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim == 3 else a, params)
    x16 = x.astype(jnp.bfloat16)

    def y(p, xx, kernel_backend="xla", **kw):
        cfg = mp.MoEConfig(**base, kernel_backend=kernel_backend, **kw)
        return mp.moe_block(p, xx, cfg).y.astype(jnp.float32)

    formats = {"bf16": {}}
    formats.update({f"fp8 {mode}": dict(fp8="blockwise", fp8_gemms=mode) for mode in MODES})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the FP8 emulation's notice
        with jax.default_matmul_precision("highest"):  # a GPU's float32 default is TF32
            y32 = y(params, x)
        emulated = {name: y(p16, x16, **kw) for name, kw in formats.items()}
        got = emulated if backend == "xla" else {
            name: y(p16, x16, backend, **kw)
            for name, kw in formats.items()
        }
    out = {}
    for name, v in got.items():
        out[name] = {"vs_float32": rel_err(v, y32), "vs_bf16": rel_err(v, got["bf16"])}
        if backend != "xla":
            out[name]["vs_emulation"] = rel_err(v, emulated[name])
    return out


def table(errors: dict, rounding: tuple[float, float]) -> str:
    cols = list(next(iter(errors.values())))
    lines = [
        "| output | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|"
    ]
    lines += [
        f"| {n} | " + " | ".join(f"{e[c]:.2%}" for c in cols) + " |" for n, e in errors.items()
    ]
    lines.append(f"e4m3, one scale per 1x{BLOCK} block, Gaussian values: {rounding[0]:.2%} per "
                 f"element, {rounding[1]:.2%} for a product of two such operands")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fp8_error",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--d_ff", type=int, default=1792)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend",
                    choices=("xla", "cuda"),
                    default="xla",
                    help="the kernel_backend of the bf16 and FP8 rows (cuda: a GPU)")
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    for name in ("d_model", "d_ff"):
        v = getattr(args, name)
        if v < BLOCK or v % BLOCK:
            ap.error(f"--{name} {v}: the FP8 recipe needs a positive multiple of {BLOCK}")
    if args.backend == "cuda":
        ok, why = kernels.cuda_status()
        if not ok:
            ap.error(f"--backend cuda: the CUDA kernels cannot run here ({why})")
    errors = measure(args.d_model, args.d_ff, args.experts, args.top_k, args.tokens, args.seed,
                     args.backend)
    rounding = e4m3_rounding(args.tokens, args.d_model, args.seed)
    print(table(errors, rounding))
    out = {
        "what":
        "relative distance of moe_block's output from float32 and bf16 under the FP8 "
        "forward, weight by weight (the pure-JAX recipe, or the CUDA kernels beside it)",
        "backend":
        args.backend,
        "date":
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine":
        platform.node(),
        "jax":
        jax.__version__,
        "device":
        str(jax.devices()[0]),
        "command":
        " ".join(["python -m benchmarks.fp8_error"] + (sys.argv[1:] if argv is None else argv)),
        "shape": {
            k: getattr(args, k)
            for k in ("d_model", "d_ff", "experts", "top_k", "tokens", "seed")
        },
        "errors":
        errors,
        "e4m3_block_rounding": {
            "element": rounding[0],
            "product": rounding[1]
        },
    }
    with open(args.json, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
