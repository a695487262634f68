"""Helpers of the tests that run `python -m experiments.main` in subprocesses
(test_experiments_e2e.py, test_run_safety.py): the small-batch flags, the subprocess's
environment (fake CPU devices), the run and the metrics records it wrote."""

import os
import subprocess
import sys
from pathlib import Path

from experiments.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# Tiny with a smaller batch (8 x 32 bytes), to stay within the suite's time budget
SMALL = ["--fdl.data.batch_size=8", "--fdl.data.seq_len=32", "--no_progress"]


def main_env(devices: int, compile_cache=None) -> dict:
    """The environment of a subprocess on `devices` fake CPU devices, importing this checkout;
    with `compile_cache` (a directory) JAX keeps every compiled program there, so the runs of a
    test that compile the same steps (a run, its resume, its eval) compile them once."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if compile_cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def run_main(args, *, devices=1, check=True, timeout=300, compile_cache=None):
    p = subprocess.run([sys.executable, "-m", "experiments.main", *args],
                       cwd=ROOT,
                       env=main_env(devices, compile_cache),
                       capture_output=True,
                       text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def records(job_dir, kind):
    return [r for r in read_metrics(Path(job_dir) / "metrics.jsonl") if r["kind"] == kind]
