"""Sampling on one GPU (the CUDA kernels where the library is built): the DeepSeek-V3 and
Qwen3-MoE families at small sizes, float32, greedy with the KV cache == the full recompute for
32 tokens, the cached logits == the full forward's (1e-4 relative), nothing dropped."""

import jax
import numpy as np
import pytest

from experiments import sample
from tests import sample_util, testutil


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek", "qwen3"])
def test_cached_equals_full_recompute_on_gpu(tmp_path, family):
    s = testutil.seed()
    rng = np.random.default_rng(s)
    job = sample_util.make_job(tmp_path / family,
                               family,
                               seed=int(rng.integers(1 << 30)),
                               mesh={"shape": (1, 1, 1)})
    sampler = sample.load_sampler(job, devices=jax.devices("gpu")[:1])
    assert sampler.mesh.devices.flat[0].platform == "gpu"
    prompts = [list(rng.integers(32, 127, size=int(n))) for n in rng.integers(2, 20, size=4)]
    with jax.default_matmul_precision("highest"):  # float32, not TF32, GEMMs
        cached = sampler.sample(prompts, max_new_tokens=32, return_logits=True)
        full = sampler.sample(prompts, max_new_tokens=32, use_cache=False, return_logits=True)
    assert cached.tokens == full.tokens, f"seed={s}"
    assert cached.dropped == 0 and full.dropped == 0, f"seed={s}"
    err = testutil.row_errs(cached.logits, full.logits)
    assert err.max() < 1e-4, f"{err.max()} seed={s}"
    assert cached.decode_tokens_per_second > 0
