"""The benchmarks' shared timing and error helpers (GPU work timed from the host with
jax.block_until_ready; no profiler).

time_paired: several functions timed in interleaved batches, so that a drift of the GPU's
clocks during the run moves them alike and their ratios stay fair (the layer, grouped GEMM
and FP8 benchmarks); time_fn: one function; rel_err: ||a - b|| / ||b|| on the device.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp


def time_paired(fns: dict, *args, target_s=0.25, reps=7, min_sample_s=0.0, spin_up_s=0.0) -> dict:
    """Median seconds per call of each function in `fns`, timed in interleaved batches (one
    batch of each per round, `reps` rounds), so that a drift of the GPU's clocks during the run
    moves them alike and their ratios stay fair. A batch is about target_s / reps long (at most
    50 calls) and at least min_sample_s (short calls: the launch gaps of a few calls would
    count); spin_up_s of calls of the first function run before the first round, so that the
    clock has left its idle state."""
    iters = {}
    for name, f in fns.items():
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        one = max(time.perf_counter() - t0, 1e-6)
        iters[name] = max(int(max(1, min(50, target_s / reps / one))),
                          math.ceil(min_sample_s / one))
    t0 = time.perf_counter()
    while fns and time.perf_counter() - t0 < spin_up_s:
        jax.block_until_ready(next(iter(fns.values()))(*args))
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                out = f(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / iters[name])
    return {name: statistics.median(t) for name, t in times.items()}


def time_fn(f, *args, target_s=0.25, reps=5):
    """Median seconds per call of one function (see module doc)."""
    return time_paired({"f": f}, *args, target_s=target_s, reps=reps)["f"]


@jax.jit
def _rel_err(a, b):
    num = jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
    return jnp.sqrt(num / jnp.maximum(jnp.sum(jnp.square(b.astype(jnp.float32))), 1e-30))


def rel_err(a, b):
    """||a - b|| / ||b|| (None if it cannot be computed, e.g. out of memory)."""
    try:
        return float(_rel_err(a, b))
    except Exception as ex:  # noqa: BLE001
        print("  rel_err failed:", repr(ex)[:200], flush=True)
        return None
