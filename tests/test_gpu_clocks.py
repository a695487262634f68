"""benchmarks/gpu_clocks.py: nvidia-smi's samples parsed and summarised, the sampler with a
stand-in nvidia-smi on PATH, and nothing sampled without one. The clocks themselves are the
benchmark's output on a GPU, never asserted here."""

import os
import stat
import time

import pytest

from benchmarks import gpu_clocks


def test_parse_keeps_whole_samples_of_the_gpu():
    text = "1980, 650.25\n[N/A], 300\n1410, 700.5\n1755, 6\n"  # a partial last line
    assert gpu_clocks.parse(text) == [(1980.0, 650.25), (1410.0, 700.5), (1755.0, 6.0)]
    two = "1980, 600\n1200, 100\n1410, 650\n1300, 90\n"  # two GPUs, in GPU order
    assert gpu_clocks.parse(two, gpu=1, num_gpus=2) == [(1200.0, 100.0), (1300.0, 90.0)]


def test_summary_is_min_median_max():
    got = gpu_clocks.summarize([(1980.0, 650.0), (1410.0, 700.0), (1755.0, 500.0)])
    assert got == {
        "sm_mhz": [1410.0, 1755.0, 1980.0],
        "power_w": [500.0, 650.0, 700.0],
        "samples": 3
    }
    assert gpu_clocks.summarize([]) is None


def _fake_nvidia_smi(tmp_path, monkeypatch):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") +
                      "\nwhile true; do echo '1800, 612.5'; sleep 0.02; done\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_sampler_reads_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch)
    with gpu_clocks.Sampler(period_ms=20) as s:
        time.sleep(0.3)
    got = s.summary()
    assert got["sm_mhz"] == [1800.0] * 3 and got["power_w"] == [612.5] * 3
    assert got["samples"] >= 2
    args = (tmp_path / "args").read_text().split()
    assert "--query-gpu=clocks.sm,power.draw" in args and "--loop-ms=20" in args


def test_sampler_without_nvidia_smi_samples_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_clocks.Sampler() as s:
        pass
    assert s.summary() is None
    with pytest.raises(ValueError, match=r"period_ms=0 must be a positive int"):
        gpu_clocks.Sampler(period_ms=0)
