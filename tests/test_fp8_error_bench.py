"""benchmarks/fp8_error.py at a small shape: the FP8 forward moves the block's output by what
e4m3's rounding predicts, each weight's share less than all of them, and bf16 is its own
reference; the e4m3 block rounding it prints is e4m3's (about 2.6% per Gaussian element)."""

import json

import pytest

from benchmarks import fp8_error
from tests.testutil import seed as _seed


def test_the_fp8_forward_error_by_weight(tmp_path, capsys):
    seed = _seed()
    out = tmp_path / "e.json"
    assert fp8_error.main([
        "--d_model", "256", "--d_ff", "384", "--experts", "4", "--tokens", "512", "--seed",
        str(seed), "--json",
        str(out)
    ]) == 0
    got = json.loads(out.read_text())
    err = {k: v["vs_bf16"] for k, v in got["errors"].items()}
    assert err["bf16"] == 0.0
    for mode in ("fp8 fwd", "fp8 wi=fwd", "fp8 wo=fwd"):
        assert 0.02 < err[mode] < 0.12, (seed, err)
    assert err["fp8 fwd"] > max(err["fp8 wi=fwd"], err["fp8 wo=fwd"]), (seed, err)
    r = got["e4m3_block_rounding"]
    assert 0.02 < r["element"] < 0.032 and r["element"] < r["product"] < 0.05, (seed, r)
    assert got["shape"]["d_model"] == 256 and "| fp8 wo=fwd |" in capsys.readouterr().out


def test_a_width_the_recipe_cannot_take_is_refused(capsys):
    with pytest.raises(SystemExit):
        fp8_error.main(["--d_model", "200"])
    assert "--d_model 200: the FP8 recipe needs a positive multiple of 128" in \
        capsys.readouterr().err
