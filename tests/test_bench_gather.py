"""benchmarks.bench_gather on the CPU: every timed function traces (its kernels' abstract
shapes) at a small shape of benchmarks.layer, and a bad --shapes names the valid ones. The
timing itself needs a Hopper GPU (and the kernel library)."""

import jax
import pytest

from benchmarks import bench_gather
from benchmarks.layer_cases import QUICK_SHAPES


@pytest.mark.parametrize("dist", ["balanced", "skewed"])
def test_every_timed_function_traces(dist):
    sh = QUICK_SHAPES["qwen3"]
    fns, x, row_map, flops, configs = bench_gather.point_fns(sh, dist)
    assert set(fns) == {"gather fwd", "tma fwd", "permute+tma fwd", "gather wgrad", "tma wgrad"}
    r = sh.t * sh.k
    assert flops == 2.0 * r * sh.m * sh.h and all(configs), configs
    for label, f in fns.items():
        out = jax.eval_shape(f, x, row_map)
        want = (sh.e, sh.m, sh.h) if "wgrad" in label else (r, sh.h)
        assert out.shape == want, (label, out.shape)


def test_bad_shape_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        bench_gather.main(["--shapes", "qwen4"])
    assert "--shapes qwen4 is invalid; valid: mixtral,qwen3,deepseek,deepseek_ep4" in (
        capsys.readouterr().err)
