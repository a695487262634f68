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


def test_the_cuda_rows_are_refused_without_the_kernels(capsys, monkeypatch):
    monkeypatch.setattr(fp8_error.kernels, "cuda_status", lambda op="": (False, "no GPU here"))
    with pytest.raises(SystemExit):
        fp8_error.main(["--backend", "cuda"])
    assert "--backend cuda: the CUDA kernels cannot run here (no GPU here)" in \
        capsys.readouterr().err


@pytest.mark.gpu
def test_the_cuda_kernels_round_as_the_emulation_does(tmp_path):
    """On a GPU: the CUDA kernels' FP8 forward sits as far from float32 as the pure-JAX recipe's,
    and near it (the same quantized operands; accumulation and summation order apart)."""
    ok, why = fp8_error.kernels.cuda_status()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "e.json"
    assert fp8_error.main([
        "--d_model", "512", "--d_ff", "768", "--experts", "4", "--tokens", "1024", "--seed",
        str(_seed()), "--backend", "cuda", "--json",
        str(out)
    ]) == 0
    err = json.loads(out.read_text())["errors"]
    assert err["bf16"]["vs_emulation"] < 0.01, err
    for mode in ("fp8 fwd", "fp8 wi=fwd", "fp8 wo=fwd"):
        assert err[mode]["vs_emulation"] < 0.02, (mode, err)
        assert 0.02 < err[mode]["vs_float32"] < 0.12, (mode, err)
