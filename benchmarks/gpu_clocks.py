"""The GPU's SM clock and power draw, sampled by nvidia-smi while a benchmark times.

The same step measured an hour apart can differ by 10% on one H200 (the Mixtral-like layer's
`cuda` at 54.2 and 59.6 ms, benchmarks/results/layer_bench_fp8_rows_rule.json and
layer_bench_fp8_microbatches.json), and the SM clock moves between 1410 and 1980 MHz under
load. `Sampler` records both beside the times, so a run's spread can be told from its clocks.

    with Sampler() as s:
        ...  # timing
    s.summary()  # {'sm_mhz': [min, median, max], 'power_w': [...], 'samples': n} or None

Without nvidia-smi (the CPU, a machine without the NVIDIA driver tools) it samples nothing
and summary() is None.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

QUERY = ("nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits")


def parse(text: str, gpu: int = 0, num_gpus: int = 1) -> list[tuple[float, float]]:
    """[(SM MHz, W)] of one GPU from nvidia-smi's csv lines (one line per GPU per sample, in
    GPU order); lines that are not two numbers ('[N/A]', a partial last line) are skipped."""
    out = []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if i % num_gpus != gpu:
            continue
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz, watts = float(parts[0]), float(parts[1])
        except (IndexError, ValueError):
            continue
        out.append((mhz, watts))
    return out


def summarize(samples: list[tuple[float, float]]) -> dict | None:
    """{'sm_mhz': [min, median, max], 'power_w': [min, median, max], 'samples': n}, or None
    without samples."""
    if not samples:
        return None

    def span(values):
        return [min(values), statistics.median(values), max(values)]

    return {
        "sm_mhz": span([m for m, _ in samples]),
        "power_w": span([w for _, w in samples]),
        "samples": len(samples)
    }


class Sampler:
    """nvidia-smi polling every `period_ms` while the `with` block runs (module doc)."""

    def __init__(self, period_ms: int = 100, gpu: int = 0):
        if not isinstance(period_ms, int) or period_ms < 1:
            raise ValueError(f"period_ms={period_ms!r} must be a positive int (milliseconds)")
        self.period_ms, self.gpu = period_ms, gpu
        self._proc = None
        self._text = ""

    def __enter__(self):
        if shutil.which(QUERY[0]) is not None:
            self._proc = subprocess.Popen(
                [*QUERY, f"--id={self.gpu}", f"--loop-ms={self.period_ms}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._text, _ = self._proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._text, _ = self._proc.communicate()
        return False

    def summary(self) -> dict | None:
        return summarize(parse(self._text))
