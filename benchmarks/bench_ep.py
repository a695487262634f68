"""Benchmark: the expert-parallel MoE layer, weak scaling from 1 to N GPUs.

    python -m benchmarks.bench_ep [--shapes mixtral,qwen3] [--tokens-per-gpu N] [--reps N]
                                  [--exchanges padded,ragged] [--out FILE.json] [--tiny]

For each shape (Mixtral-like M=4096 H=14336 E=8 k=2, Qwen3-MoE-like M=2048 H=768 E=128 k=8;
bf16 params and x), per-GPU tokens fixed (weak scaling):
  1 GPU:   jit(value_and_grad(sum(y * cot)) w.r.t. params and x), no mesh, T = tokens_per_gpu.
  N GPUs:  the same on a Mesh(jax.devices(), ('ep',)), MeshResources(ep='ep'),
           T = N * tokens_per_gpu, x split over 'ep' on dim 0, weights placed by
           ep_bootstrap(...).weight_specs; once per exchange kind ('padded', 'ragged').
  Weak-scaling efficiency = t_1 / t_N.
Collectives on the N devices (jitted jax.shard_map over 'ep'), of the bytes of one direction of
the token exchange (rows = tokens_per_gpu * k per device, d_model columns, bf16):
jax.lax.all_to_all, jax.lax.psum and (GPU only) jax.lax.ragged_all_to_all with even splits,
the primitive the 'ragged' exchange uses. GB/s = bytes per device / time. The layer's own
exchange (moe_praxis.dispatch.exchange) is not timed alone: it takes the expert computation
as an argument and is not separable simply, so it is skipped (said in the output).
Times: warm up (compile), then the median of --reps wall-clock calls with block_until_ready.
Prints two markdown tables and writes JSON with a `meta` (date UTC, versions, device, N).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp

SHAPES = {  # name: (M, H, E, k)
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
}
TINY = ("tiny", (64, 128, 8, 2))
AXIS = "ep"
EXCHANGE_SKIP_NOTE = ("the layer's own exchange is not timed alone (it takes the expert "
                      "computation as an argument; not separable simply): skipped")


def time_call(f, *args, reps: int) -> float:
    """Median wall-clock seconds of f(*args) over `reps` calls, after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _loss_grad_fn(cfg, mesh, res):

    def loss(params, x, cot):
        out = mp.moe_block(params, x, cfg, mesh=mesh, resources=res)
        return jnp.sum(out.y.astype(jnp.float32) * cot.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_layer(shape, exchange, tokens_per_gpu, reps, mesh=None):
    """Seconds per fwd+bwd of the whole layer, on one device (mesh None) or on `mesh`."""
    m, h, e, k = shape
    cfg = mp.MoEConfig(d_model=m,
                       d_ff=h,
                       num_experts=e,
                       top_k=k,
                       ep_exchange=exchange,
                       kernel_backend="auto")
    n = 1 if mesh is None else mesh.devices.size
    t = n * tokens_per_gpu
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = mp.init_moe_params(k1, cfg, jnp.bfloat16)
    x = jax.random.normal(k2, (t, m), jnp.bfloat16)
    cot = jax.random.normal(k3, (t, m), jnp.bfloat16)
    res = None
    if mesh is not None:
        res = mp.MeshResources(ep=AXIS)
        specs = mp.ep_bootstrap(mesh, res, e).weight_specs
        params = {
            name: jax.device_put(v, NamedSharding(mesh, specs.get(name, P())))
            for name, v in params.items()
        }
        xs = NamedSharding(mesh, P(AXIS, None))
        x, cot = jax.device_put(x, xs), jax.device_put(cot, xs)
    f = _loss_grad_fn(cfg, mesh, res)
    return time_call(f, params, x, cot, reps=reps)


def _collective_fns(mesh, rows):
    n = mesh.devices.size
    spec = P(AXIS, None)

    def a2a(b):
        return jax.lax.all_to_all(b, AXIS, 0, 0, tiled=True)

    def psum(b):
        return jax.lax.psum(b, AXIS)

    def ragged(b):
        per = rows // n
        me = jax.lax.axis_index(AXIS)
        sizes = jnp.full((n, ), per, jnp.int32)
        in_off = jnp.arange(n, dtype=jnp.int32) * per
        out_off = jnp.full((n, ), me * per, jnp.int32)
        return jax.lax.ragged_all_to_all(b,
                                         jnp.zeros_like(b),
                                         in_off,
                                         sizes,
                                         out_off,
                                         sizes,
                                         axis_name=AXIS)

    fns = {"all_to_all": a2a, "psum": psum}
    if jax.default_backend() == "gpu":
        fns["ragged_all_to_all (even splits)"] = ragged
    return {
        name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
        for name, f in fns.items()
    }


def time_collectives(mesh, rows, m, reps):
    n = mesh.devices.size
    buf = jax.random.normal(jax.random.key(1), (n * rows, m), jnp.bfloat16)
    buf = jax.device_put(buf, NamedSharding(mesh, P(AXIS, None)))
    nbytes = rows * m * 2
    out = []
    for name, f in _collective_fns(mesh, rows).items():
        try:
            s = time_call(f, buf, reps=reps)
            out.append(dict(op=name, bytes_per_device=nbytes, s=s, gb_s=nbytes / s / 1e9))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            out.append(dict(op=name, bytes_per_device=nbytes, error=traceback.format_exc()[-2000:]))
    return out


def _ms(r, key):
    return f"{r[key] * 1e3:.3f}" if r.get(key) is not None else "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_ep")
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--exchanges", default="padded,ragged")
    ap.add_argument("--out", default="bench_ep.json")
    ap.add_argument("--tiny", action="store_true", help="M=64 H=128 E=8 k=2, 64 tokens, 2 reps")
    args = ap.parse_args(argv)
    if args.tiny:
        shapes = [TINY]
        tokens_per_gpu, reps = 64, 2
    else:
        shapes = [(s, SHAPES[s]) for s in args.shapes.split(",")]
        tokens_per_gpu, reps = args.tokens_per_gpu, args.reps
    devs = jax.devices()
    n = len(devs)
    backend = jax.default_backend()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=devs[0].device_kind,
                backend=backend,
                num_devices=n,
                jax=jax.__version__,
                jaxlib=jaxlib.__version__,
                python=platform.python_version(),
                tokens_per_gpu=tokens_per_gpu,
                reps=reps)
    print(meta, flush=True)
    notes = []
    exchanges = []
    for ex in args.exchanges.split(","):
        if ex == "ragged" and backend != "gpu":
            notes.append(f"'ragged' skipped: needs a GPU backend (this is {backend!r})")
        else:
            exchanges.append(ex)
    mesh = None
    if n >= 2:
        mesh = jax.sharding.Mesh(np.array(devs), (AXIS, ))
    else:
        notes.append("N-GPU rows and collectives skipped: need >= 2 devices (1 visible)")
    for note in notes:
        print("note:", note, flush=True)

    rows, ok = [], True
    for name, shape in shapes:
        m, h, e, k = shape
        try:
            t1 = time_layer(shape, "padded", tokens_per_gpu, reps)  # no exchange on 1 device
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok, t1 = False, None
        print(f"{name}: 1 device fwd+bwd {t1 * 1e3 if t1 else float('nan'):.3f} ms", flush=True)
        for ex in exchanges:
            row = dict(shape=name, M=m, H=h, E=e, k=k, exchange=ex, N=n, t1_s=t1, tN_s=None)
            if mesh is not None:
                try:
                    row["tN_s"] = time_layer(shape, ex, tokens_per_gpu, reps, mesh)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    ok = False
                    row["error"] = traceback.format_exc()[-2000:]
            row["efficiency"] = (t1 / row["tN_s"]) if t1 and row["tN_s"] else None
            print(f"{name} {ex}: N={n} {_ms(row, 'tN_s')} ms", flush=True)
            rows.append(row)

    coll = []
    if mesh is not None:
        for name, (m, h, e, k) in shapes:
            r_dev = tokens_per_gpu * k
            for c in time_collectives(mesh, r_dev, m, reps):
                c.update(shape=name, rows_per_device=r_dev, N=n)
                ok = ok and "error" not in c
                coll.append(c)
    notes.append(EXCHANGE_SKIP_NOTE)

    print()
    print("| shape | exchange | N | ms 1 GPU | ms N GPUs | weak-scaling efficiency |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        eff = f"{r['efficiency']:.3f}" if r["efficiency"] is not None else "n/a"
        print(f"| {r['shape']} | {r['exchange']} | {r['N']} | {_ms(r, 't1_s')} | "
              f"{_ms(r, 'tN_s')} | {eff} |")
    print()
    print("| shape | op | N | bytes per device | ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for c in coll:
        gbs = f"{c['gb_s']:.2f}" if "gb_s" in c else "failed"
        print(f"| {c['shape']} | {c['op']} | {c['N']} | {c['bytes_per_device']} | "
              f"{_ms(c, 's')} | {gbs} |")
    if not coll:
        print("| (none: need >= 2 devices) | | | | | |")
    print()
    for note in notes:
        print("note:", note)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, notes=notes, layer=rows, collectives=coll), f, indent=1)
    print("wrote", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
