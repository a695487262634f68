"""The GPU kernels of a JAX profiler trace: `jax.profiler.trace(dir, create_perfetto_trace=True)`
writes a perfetto (Chrome trace) JSON next to its .xplane.pb; the kernels and memsets sit on its
"Stream #..." lines of the GPU processes ("XLA Ops" and other lines repeat them). Shared by
bench_kernels (--device-time) and the layer benchmark's --breakdown."""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil

import jax


class NoGpuEvents(RuntimeError):
    """The trace holds no GPU stream events (a CPU run, or a profiler without CUPTI)."""


def traced(fn, args, reps: int, trace_dir: str, *, pipelined: bool = False) -> None:
    """Runs fn(*args) `reps` times (after one untraced call) under jax.profiler.trace, waiting
    for each call, or with `pipelined` for the last only (as a training loop runs: what the GPU
    then waits for between two calls is the host)."""
    jax.block_until_ready(fn(*args))
    shutil.rmtree(trace_dir, ignore_errors=True)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        out = None
        for _ in range(reps):
            out = fn(*args)
            if not pipelined:
                jax.block_until_ready(out)
        jax.block_until_ready(out)


def gpu_stream_events(trace_dir: str, line: str = "Stream") -> list[dict]:
    """The complete ('X') events on the GPU lines whose name starts with `line` ("Stream": the
    kernels and memsets; "XLA Ops": the HLO ops they ran for) of the newest perfetto trace
    under `trace_dir`: dicts with name, ts, dur (microseconds) and args (the profiler's stats,
    e.g. hlo_op, hlo_module, correlation_id, where it wrote them). Raises NoGpuEvents naming
    what the trace has instead."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise NoGpuEvents(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {pid for pid, name in procs.items() if "GPU" in name}
    streams = {k for k, name in threads.items() if k[0] in gpu and name.startswith(line)}
    if not streams:
        raise NoGpuEvents(
            f"no GPU {line!r} lines in the trace: processes {sorted(procs.values())}, "
            f"GPU threads {sorted(n for k, n in threads.items() if k[0] in gpu)}")
    return [
        dict(name=e.get("name", "?"),
             ts=float(e.get("ts", 0.0)),
             dur=float(e.get("dur", 0.0)),
             args=e.get("args") or {}) for e in events
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams
    ]
