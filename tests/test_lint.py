"""The whole tree is formatted by the one formatter configured in setup.cfg ([yapf])."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tree_is_yapf_formatted():
    pytest.importorskip("yapf", reason="yapf comes with the dev extra (make install)")
    r = subprocess.run([
        sys.executable, "-m", "yapf", "--diff", "-r", "moe_praxis", "configs", "experiments",
        "benchmarks", "tests"
    ],
                       cwd=ROOT,
                       capture_output=True,
                       text=True,
                       timeout=600)
    changed = [line[4:] for line in r.stdout.splitlines() if line.startswith("+++ ")]
    assert r.returncode == 0 and not changed, (
        f"not yapf-formatted (run `make format`): {changed}\n{r.stderr[-1000:]}")
