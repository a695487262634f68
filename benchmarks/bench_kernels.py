"""CUDA kernel benchmark: `python -m benchmarks.bench_kernels [--out FILE.json]`.

Times each moe_praxis CUDA kernel against its XLA reference (the pure-JAX op, jitted) at
T=16384 tokens, E=64 experts, k=8, d=4096 (SwiGLU rows R=T*k of width --hidden, default 2048),
on one GPU, and prints a table: time per call, achieved bandwidth (the fewest bytes the op
must move: every input read once, every output written once) as a fraction of the device's
copy bandwidth (about 4.3 TB/s measured on the H200; also measured here, an elementwise
float32 read+write of 2 GiB), and the speedup over XLA. Writes the numbers as JSON.

Timing: one jitted function applies the op to `n` independent input sets (distinct buffers:
no CSE, no loop-invariant hoisting, every output returned so nothing is dead), warmed up,
then called `reps` times; the median wall time between block_until_ready calls, divided by n.
Host dispatch is amortised over the n calls inside one executable.
`--device-time` also sums each op's GPU kernel (and memset) durations from a JAX profiler trace
(perfetto JSON): the GPU time without launch gaps, and the kernels per call.

Targets: no kernel slower than its XLA reference; fused router fwd+bwd and
permute+unpermute at least 2x faster than XLA; every kernel at 60% or more of copy bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import trace
from moe_praxis import ops, routing
from moe_praxis.config import MoEConfig
from moe_praxis.ops.router import router_cuda

NOMINAL_COPY_BW = 4.3e12  # bytes/s, device-to-device copy on the H200 (read + write)


def _batched(fn):
    """One executable applying fn to every input set (host dispatch amortised over them)."""
    return jax.jit(lambda ins: [fn(*i) for i in ins])


def _time(fn, inputs, reps):
    f = _batched(fn)
    jax.block_until_ready(f(inputs))  # compile + warm up
    jax.block_until_ready(f(inputs))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(inputs))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / len(inputs)


def device_kernels(fn, inputs, reps, trace_dir):
    """Device time per op call from JAX's profiler (CUPTI): `reps` calls of the jitted `fn` over
    all `inputs` under jax.profiler.trace; returns (us per op call, kernels per op call,
    {kernel name: us per op call}), summed over the GPU streams' kernel and memset events.
    This is the time the GPU spends in the op's kernels, without the launch gaps that the
    wall-clock numbers include."""
    f = _batched(fn)
    trace.traced(f, (inputs, ), reps, trace_dir)
    calls = reps * len(inputs)
    per_name = collections.Counter()
    events = trace.gpu_stream_events(trace_dir)
    for e in events:
        per_name[e["name"]] += e["dur"] / calls
    count = len(events)
    return sum(per_name.values()), count / calls, dict(per_name.most_common())


def _rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


def cases(t, e, k, d, h):
    """name -> (bytes moved, make_inputs(n), ours(*inputs), xla(*inputs))."""
    r = t * k
    cfg = MoEConfig(d_model=d, d_ff=h, num_experts=e, top_k=k)

    # Every array an op reads is an input of the timed function (as in a model, where counts,
    # bias and cotangents come from other computations): a constant (jnp.full, ones_like) would
    # be fused into XLA's own kernels for free but materialised by an extra kernel before a
    # custom call, which measured that broadcast instead of the kernel (seen 2026-11-29).
    def logits_in(n):
        out = []
        for kk in _keys(1, n):
            k1, k2, k3, k4 = jax.random.split(kk, 4)
            out.append((2 * jax.random.normal(k1, (t, e), jnp.float32),
                        0.1 * jax.random.normal(k2, (e, ), jnp.float32),
                        1e-3 * jax.random.normal(k3, (t, e), jnp.float32),
                        jax.random.normal(k4, (t, k), jnp.float32)))
        return out

    def probs_in(n):
        out = []
        for kk in _keys(2, n):
            k1, k2 = jax.random.split(kk)
            out.append((jax.nn.softmax(jax.random.normal(k1, (t, e), jnp.float32),
                                       -1), jax.random.randint(k2, (e, ), 0, 2 * r // e,
                                                               jnp.int32)))
        return out

    def router_ours(l, b, dp, dw):
        del dp, dw
        return router_cuda(l, b, **routing.router_args(cfg))

    def router_xla(l, b, dp, dw):
        del dp, dw
        o = routing.route_logits_reference(l, cfg, b)
        return o.probs, o.expert_ids, o.weights

    def fwd_bwd(fn):

        def run(l, b, dp, dw):
            out, pull = jax.vjp(lambda x: (lambda o: (o[0], o[2]))(fn(x, b, dp, dw)), l)
            return out, pull((dp, dw))[0]

        return run

    aux_ours = lambda p, f: ops.aux_loss(p, f, top_k=k, coeff=0.01, backend="cuda")
    aux_xla = lambda p, f: ops.aux_loss(p, f, top_k=k, coeff=0.01, backend="xla")

    def gu_in(n, dout=False):
        out = []
        for kk in _keys(3, n):
            k1, k2, k3 = jax.random.split(kk, 3)
            g = jax.random.normal(k1, (r, h), jnp.bfloat16)
            u = jax.random.normal(k2, (r, h), jnp.bfloat16)
            out.append((g, u, jax.random.normal(k3, (r, h), jnp.bfloat16)) if dout else (g, u))
        return out

    def swiglu_bwd(backend):

        def run(g, u, dy):
            _, pull = jax.vjp(lambda a, b: ops.swiglu(a, b, backend=backend), g, u)
            return pull(dy)

        return run

    def gu_w_in(n):  # with the routing weight of each row (moe_block's SwiGLU)
        return [(g, u, dy, jax.random.uniform(kk, (r, ), jnp.float32))
                for (g, u, dy), kk in zip(gu_in(n, dout=True), _keys(7, n))]

    def swiglu_w_bwd(backend):

        def run(g, u, dy, w):
            _, pull = jax.vjp(lambda a, b, c: ops.swiglu(a, b, c, backend=backend), g, u, w)
            return pull(dy)

        return run

    rng = np.random.default_rng(0)
    ids = rng.integers(0, e, size=(t, k))
    order = np.argsort(ids.reshape(-1), kind="stable")
    row_map = jnp.asarray(order // k, jnp.int32)

    def x_in(n):
        return [(jax.random.normal(kk, (t, d), jnp.bfloat16), ) for kk in _keys(4, n)]

    def y_in(n):
        return [(jax.random.normal(kk, (r, d), jnp.bfloat16), ) for kk in _keys(5, n)]

    def perm_unperm(backend):
        return lambda x: ops.unpermute(
            ops.permute(x, row_map, backend=backend), row_map, t, backend=backend)

    # moe_block's expert-side elementwise work around the down projection, forward + backward,
    # in the two structures: the routing weights applied after the FFN (a float32 [R, d] copy
    # scaled, then unpermuted: dispatch.combine_rows) or multiplied into the SwiGLU kernel with
    # a plain bf16 unpermute (what moe_block does). Same inputs; both compute the gradients of
    # g, u, y and w.
    from moe_praxis import dispatch as dispatch_lib
    disp = dispatch_lib.Dispatch(order=jnp.asarray(order, jnp.int32),
                                 row_map=row_map,
                                 sorted_experts=jnp.asarray(np.sort(ids.reshape(-1)), jnp.int32),
                                 group_sizes=jnp.asarray(np.bincount(ids.reshape(-1), minlength=e),
                                                         jnp.int32),
                                 dropped_tokens=jnp.zeros((), jnp.int32))

    def combine_in(n):
        out = []
        for kk in _keys(6, n):
            k1, k2, k3, k4, k5, k6 = jax.random.split(kk, 6)
            out.append(
                (jax.random.normal(k1, (r, h),
                                   jnp.bfloat16), jax.random.normal(k2, (r, h), jnp.bfloat16),
                 jax.random.normal(k3, (r, d), jnp.bfloat16),
                 jax.nn.softmax(jax.random.normal(k4, (t, k), jnp.float32),
                                -1), jax.random.normal(k5, (r, h), jnp.bfloat16),
                 jax.random.normal(k6, (t, d), jnp.bfloat16)))
        return out

    def combine(weights_in_swiglu, backend):

        def fwd(g, u, y, w):
            if weights_in_swiglu:
                act = ops.swiglu(g, u, dispatch_lib.row_weights(w, disp), backend=backend)
                return act, ops.unpermute(y, row_map, t, backend=backend)
            act = ops.swiglu(g, u, backend=backend)
            return act, dispatch_lib.combine_rows(y, w, disp, t, backend=backend)

        def run(g, u, y, w, dact, dy):
            out, pull = jax.vjp(fwd, g, u, y, w)
            return out, pull((dact, dy))

        return run

    te4, tk8, rd2, td2, rh2 = t * e * 4, t * k * 8, r * d * 2, t * d * 2, r * h * 2
    comb_bytes = 3 * rh2 + 5 * rh2 + 2 * (rd2 + td2) + rd2
    return {
        "aux_loss fwd": (te4 + e * 4, probs_in, aux_ours, aux_xla),
        "aux_loss bwd": (te4 + e * 4, probs_in, jax.grad(aux_ours), jax.grad(aux_xla)),
        "router fwd": (2 * te4 + tk8 + e * 4, logits_in, router_ours, router_xla),
        "router fwd+bwd": (2 * te4 + tk8 + e * 4 + 3 * te4 + tk8, logits_in, fwd_bwd(router_ours),
                           fwd_bwd(router_xla)),
        "swiglu fwd bf16": (3 * rh2, gu_in, lambda g, u: ops.swiglu(g, u, backend="cuda"),
                            lambda g, u: ops.swiglu(g, u, backend="xla")),
        "swiglu bwd bf16":
        (5 * rh2, functools.partial(gu_in, dout=True), swiglu_bwd("cuda"), swiglu_bwd("xla")),
        "swiglu(w) bwd bf16":
        (5 * rh2 + 2 * r * 4, gu_w_in, swiglu_w_bwd("cuda"), swiglu_w_bwd("xla")),
        "permute bf16": (td2 + rd2 + r * 4, x_in, lambda x: ops.permute(x, row_map, backend="cuda"),
                         lambda x: ops.permute(x, row_map, backend="xla")),
        "unpermute bf16":
        (rd2 + td2 + r * 4, y_in, lambda y: ops.unpermute(y, row_map, t, backend="cuda"),
         lambda y: ops.unpermute(y, row_map, t, backend="xla")),
        "permute+unpermute bf16": (2 * (td2 + rd2 + r * 4), x_in, perm_unperm("cuda"),
                                   perm_unperm("xla")),
        "swiglu+combine_rows fwd+bwd bf16": (comb_bytes, combine_in, combine(False, "cuda"),
                                             combine(False, "xla")),
        "swiglu(w)+unpermute fwd+bwd bf16": (comb_bytes, combine_in, combine(True, "cuda"),
                                             combine(True, "xla")),
    }


def copy_bandwidth(reps, n_el=1 << 29):
    """Bytes/s of an elementwise float32 x * 2 over n_el elements (2 GiB by default; read +
    write), the best of 2 runs."""
    xs = [(jax.random.normal(kk, (n_el, ), jnp.float32), ) for kk in _keys(9, 3)]
    sec = min(_time(lambda x: x * 2, xs, reps) for _ in range(2))
    del xs
    return 2 * n_el * 4 / sec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048, help="SwiGLU width H")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--out", default="runs/bench_kernels.json")
    ap.add_argument("--n",
                    type=int,
                    default=None,
                    help="input sets per timed call (default: enough for ~2 GB of traffic)")
    ap.add_argument("--no-copy-bw",
                    action="store_true",
                    help="skip measuring copy bandwidth (use the nominal 4.3 TB/s; for profilers)")
    ap.add_argument("--device-time",
                    action="store_true",
                    help="also measure each op's GPU kernel time with JAX's profiler (perfetto)")
    ap.add_argument("--hlo-dir",
                    default=None,
                    help="write the optimized HLO of each case's ours / XLA function here")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    info = ops.backend_info()
    if not info["cuda"]["usable"]:
        print(f"bench_kernels: CUDA kernels not usable: {info['cuda']['reason']}", file=sys.stderr)
        return 1
    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.device_kind,
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        "python": platform.python_version(),
        "library": info["cuda"]["reason"],
        "T": args.tokens,
        "E": args.experts,
        "k": args.top_k,
        "d": args.d_model,
        "H": args.hidden,
    }
    copy_bw = NOMINAL_COPY_BW if args.no_copy_bw else copy_bandwidth(args.reps)
    meta["copy_bw_measured"] = copy_bw
    print(f"# {meta['date']} {meta['device']} jax {meta['jax']}; T={args.tokens} "
          f"E={args.experts} k={args.top_k} d={args.d_model} H={args.hidden}; copy bandwidth "
          f"measured {copy_bw / 1e12:.2f} TB/s (nominal {NOMINAL_COPY_BW / 1e12:.1f})")
    rows = []
    todo = cases(args.tokens, args.experts, args.top_k, args.d_model, args.hidden)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    for name, (nbytes, make, ours, xla) in todo.items():
        n = args.n or int(min(64, max(4, 8e9 // max(nbytes, 1) // 4)))
        inputs = make(n)
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            for tag, fn in (("ours", ours), ("xla", xla)):
                text = jax.jit(fn).lower(*inputs[0]).compile().as_text()
                with open(os.path.join(args.hlo_dir, f"{name.replace(' ', '_')}.{tag}.hlo"),
                          "w") as fh:
                    fh.write(text)
        try:
            err = _rel(
                jax.tree.leaves(jax.jit(ours)(*inputs[0]))[0],
                jax.tree.leaves(jax.jit(xla)(*inputs[0]))[0])
            t_ours = _time(ours, inputs, args.reps)
            t_xla = _time(xla, inputs, args.reps)
            dev = {}
            if args.device_time:
                try:  # a profiler problem costs the GPU-time columns, not the row
                    for tag, fn in (("ours", ours), ("xla", xla)):
                        us, nk, names = device_kernels(fn, inputs, 3,
                                                       f"/tmp/bench_kernels_trace_{tag}")
                        dev[tag] = {"device_us": us, "kernels_per_call": nk, "by_kernel_us": names}
                except Exception as ex:  # noqa: BLE001
                    print(f"{name}: --device-time failed: {type(ex).__name__}: {str(ex)[:300]}")
                    dev = {}
        except Exception as ex:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
            rows.append({"kernel": name, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
            continue
        finally:
            del inputs
        row = {
            "kernel": name,
            "bytes": nbytes,
            "n": n,
            "ours_us": t_ours * 1e6,
            "xla_us": t_xla * 1e6,
            "speedup": t_xla / t_ours,
            "ours_TBps": nbytes / t_ours / 1e12,
            "xla_TBps": nbytes / t_xla / 1e12,
            "ours_frac_nominal": nbytes / t_ours / NOMINAL_COPY_BW,
            "ours_frac_measured": nbytes / t_ours / copy_bw,
            "rel_err_first_output": err,
        }
        if dev:
            row["device"] = dev
            row["ours_device_frac_nominal"] = nbytes / (dev["ours"]["device_us"] * 1e-6) / \
                NOMINAL_COPY_BW
        rows.append(row)
        print(f"  {name}: {row['ours_us']:.1f} us vs XLA {row['xla_us']:.1f} us", flush=True)
    hdr = (f"| kernel | ours (us) | XLA (us) | speedup | ours TB/s | % of 4.3 TB/s | "
           f"% of measured copy | XLA TB/s | rel. err |")
    lines = [hdr, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | failed: {r['error'][:60]} |")
            continue
        lines.append(
            f"| {r['kernel']} | {r['ours_us']:.1f} | {r['xla_us']:.1f} | "
            f"{r['speedup']:.2f}x | {r['ours_TBps']:.2f} | "
            f"{100 * r['ours_frac_nominal']:.0f}% | {100 * r['ours_frac_measured']:.0f}% | "
            f"{r['xla_TBps']:.2f} | {r['rel_err_first_output']:.1e} |")
    print("\n".join(lines))
    dev_rows = [r for r in rows if "device" in r]
    if dev_rows:
        lines = [
            "| kernel | ours GPU us | kernels | XLA GPU us | kernels | ours % of 4.3 TB/s (GPU time) |",
            "|" + "---|" * 6
        ]
        for r in dev_rows:
            o, x = r["device"]["ours"], r["device"]["xla"]
            lines.append(f"| {r['kernel']} | {o['device_us']:.1f} | {o['kernels_per_call']:.1f} | "
                         f"{x['device_us']:.1f} | {x['kernels_per_call']:.1f} | "
                         f"{100 * r['ours_device_frac_nominal']:.0f}% |")
        print("GPU kernel time per call (JAX profiler; launch gaps excluded):")
        print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
