"""ops.expert_sort (the dispatch's stable sort of the token copies by expert) on the CPU: the
reference against NumPy's stable argsort, sort_copies on it, its errors, and the lowering of
moe_block for CUDA (the sort kernels instead of XLA's sort); tests/test_kernels_gpu.py runs
the kernels against the same NumPy oracle."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.dispatch import sort
from moe_praxis.ops.expert_sort import MAX_EXPERTS
from tests import kernel_reference as ref
from tests.grouped_gemm_util import _fake_device, cuda_module


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "one", "empty", "dropped"])
@pytest.mark.parametrize("t,k,e", [(1, 1, 1), (37, 3, 5), (1500, 8, 128), (5000, 2, 1024)])
def test_reference_is_numpys_stable_argsort(pattern, t, k, e):
    rng = np.random.default_rng(ref.seed())
    keys = ref.expert_sort_keys(t, k, e, pattern, rng)
    got = ops.expert_sort(jnp.asarray(keys), e, k, backend="xla")
    want = ref.expert_sort(keys, e, k)
    for name, g, w in zip(("order", "sorted_keys", "row_map", "group_sizes"), got, want):
        assert g.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} ({pattern})")


def test_sort_copies_is_the_expert_sort_of_the_kept_copies():
    rng = np.random.default_rng(ref.seed())
    t, k, e = 300, 4, 16
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    keep = rng.random((t, k)) > 0.2
    d = sort.sort_copies(jnp.asarray(ids), jnp.asarray(keep), e, jnp.int32(7), backend="xla")
    order, sorted_e, row_map, sizes = ref.expert_sort(np.where(keep, ids, e).reshape(-1), e, k)
    np.testing.assert_array_equal(np.asarray(d.order), order)
    np.testing.assert_array_equal(np.asarray(d.sorted_experts), sorted_e)
    np.testing.assert_array_equal(np.asarray(d.row_map), row_map)
    np.testing.assert_array_equal(np.asarray(d.group_sizes), sizes)
    assert int(d.group_sizes.sum()) == int(keep.sum()) and int(d.dropped_tokens) == 7


@pytest.mark.parametrize("shape,e,k", [((6, 2), 4, 2), ((7, ), 4, 2), ((8, ), 0, 2), ((8, ), 4, 0)])
def test_bad_arguments_name_the_values_and_what_is_valid(shape, e, k):
    with pytest.raises(ValueError, match=r"expert_sort: keys of shape .* are invalid; valid: "):
        ops.expert_sort(jnp.zeros(shape, jnp.int32), e, k, backend="xla")


def _cuda_targets(monkeypatch, cfg):
    """The FFI targets and the sorts of moe_block's fwd+bwd lowered for CUDA (faked Hopper)."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    params = mp.init_moe_params(jax.random.key(ref.seed()), cfg)
    x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)

    def step(p, xx):
        return jax.grad(lambda a: jnp.sum(mp.moe_block(p, a, cfg).y.astype(jnp.float32)))(xx)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = cuda_module(jax.jit(step), params, x)
    return (re.findall(r"custom_call @(moe_\w+)",
                       text), text.count("stablehlo.sort"), [str(w.message) for w in caught])


def test_block_lowered_for_cuda_sorts_with_the_kernels(monkeypatch):
    cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=64, d_ff=128, kernel_backend="cuda")
    targets, sorts, _ = _cuda_targets(monkeypatch, cfg)
    assert targets.count("moe_expert_sort") == 1, targets
    assert sorts == 0


def test_more_experts_than_the_kernel_counts_sort_in_xla_with_a_warning(monkeypatch):
    cfg = mp.MoEConfig(num_experts=MAX_EXPERTS + 8,
                       top_k=2,
                       d_model=64,
                       d_ff=128,
                       kernel_backend="cuda")
    targets, sorts, warned = _cuda_targets(monkeypatch, cfg)
    assert "moe_expert_sort" not in targets and sorts >= 1
    assert any("expert_sort runs the XLA reference" in w and "num_experts=1032" in w
               for w in warned), warned


@pytest.mark.parametrize("policy,xla_sorts", [("position", 0), ("weight", 1)])
def test_capacity_paths_sort_by_expert_with_the_kernels(monkeypatch, policy, xla_sorts):
    """With a capacity, the copies in priority order are sorted by expert with the kernels too:
    'position' needs no other sort (its priority order is a fixed permutation), 'weight' keeps
    XLA's sort of the routing weights."""
    cfg = mp.MoEConfig(num_experts=8,
                       top_k=2,
                       d_model=64,
                       d_ff=128,
                       kernel_backend="cuda",
                       capacity_factor=1.0,
                       drop_policy=policy)
    targets, sorts, _ = _cuda_targets(monkeypatch, cfg)
    assert targets.count("moe_expert_sort") >= 2, targets  # the capacity's and the dispatch's
    assert sorts == xla_sorts
