"""permute_pair (the rows for the gate and up projections, their two cotangents summed in the
permute's backward, one unpermute pass over both, instead of an [R, M] add) and the permute
index (the CSR inverse made once per dispatch). CPU: the references and the lowering for CUDA;
tests/test_kernels_gpu.py runs the kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import experts, ops
from moe_praxis.config import MoEConfig
from moe_praxis.dispatch import sort
from moe_praxis.ops.permute import (permute_cuda, permute_index_cuda, permute_index_reference,
                                    permute_pair_cuda, unpermute_cuda)
from tests import kernel_reference as ref
from tests.grouped_gemm_util import _fake_device, cuda_module

F32_TOL = 1e-6


def _case(rng, t=17, k=3, m=8):
    rm = ref.row_map_for(t, k, 5, rng)
    rm[0] = -2  # out of range below: reads zeros, receives no gradient
    x = jnp.asarray(rng.standard_normal((t, m)), jnp.float32)
    c1 = jnp.asarray(rng.standard_normal((t * k, m)), jnp.float32)
    c2 = jnp.asarray(rng.standard_normal((t * k, m)), jnp.float32)
    return rm, x, c1, c2


@pytest.mark.parametrize("backend", ["cuda-vjp", "xla"])
def test_permute_pair_rows_and_gradient_against_float64(backend):
    """Both outputs are permute's rows; d x = unpermute(c1 + c2), on the custom_vjp (its
    reference side on the CPU) and on the plain path."""
    rng = np.random.default_rng(ref.seed())
    t = 17
    rm, x, c1, c2 = _case(rng, t)
    row_map = jnp.asarray(rm)
    index = permute_index_cuda(row_map, t)
    pair = (lambda a: permute_pair_cuda(a, row_map, index)) if backend == "cuda-vjp" else (
        lambda a: ops.permute_pair(a, row_map, backend="xla"))
    y1, y2 = pair(x)
    np.testing.assert_array_equal(np.asarray(y1), ref.permute(x, rm))
    np.testing.assert_array_equal(np.asarray(y2), ref.permute(x, rm))

    def loss(a):
        p, q = pair(a)
        return jnp.sum(p * c1) + jnp.sum(q * c2)

    gx = jax.grad(loss)(x)
    want = ref.unpermute(np.asarray(c1, np.float64) + np.asarray(c2, np.float64), rm, t)
    assert ref.rel_err(gx, want) <= F32_TOL
    # the reference of the kernel: float32 sums rounded once to the input dtype
    got = ops.unpermute2_reference(c1.astype(jnp.bfloat16), c2.astype(jnp.bfloat16), row_map, t)
    assert got.dtype == jnp.bfloat16
    want = ref.unpermute(
        np.asarray(c1.astype(jnp.bfloat16), np.float64) +
        np.asarray(c2.astype(jnp.bfloat16), np.float64), rm, t)
    assert ref.rel_err(got, want) <= 1e-2


def test_permute_pair_backward_lowers_to_one_unpermute_of_both_for_cuda():
    """Lowered for CUDA (no GPU needed): the backward of a loss over both rows is one indexed
    unpermute of two inputs, no plain moe_unpermute, and no [R, M] add of the two cotangents."""
    rng = np.random.default_rng(ref.seed())
    rm, x, c1, c2 = _case(rng, t=64, k=4, m=128)
    row_map = jnp.asarray(rm)

    def loss(a):
        p, q = permute_pair_cuda(a.astype(jnp.bfloat16), row_map, permute_index_cuda(row_map, 64))
        return jnp.sum(p.astype(jnp.float32) * c1) + jnp.sum(q.astype(jnp.float32) * c2)

    text = jax.jit(jax.grad(loss)).trace(x).lower(lowering_platforms=("cuda", )).as_text()
    calls = re.findall(r"custom_call @(moe_\w+)\(.*", text)
    assert [c for c in calls if "unpermute" in c] == ["moe_unpermute_indexed"], calls
    line = next(ln for ln in text.splitlines() if "custom_call @moe_unpermute_indexed(" in ln)
    assert "two = true" in line, line
    r, m = c1.shape
    assert not [ln for ln in text.splitlines() if "add" in ln and f"{r}x{m}xbf16" in ln]


def test_reads_rows_twice_and_rows_up_only_where_two_projections_read_the_rows():
    base = dict(d_model=16, d_ff=32, num_experts=4, top_k=2)
    assert experts.reads_rows_twice(MoEConfig(**base))
    assert not experts.reads_rows_twice(MoEConfig(**base, fuse_gate_up=True))
    assert not experts.reads_rows_twice(MoEConfig(**base, gated=False))
    assert not experts.reads_rows_twice(
        MoEConfig(d_model=128, d_ff=128, num_experts=4, top_k=2, fp8="blockwise"))
    cfg = MoEConfig(**base, gated=False)
    rows = jnp.zeros((8, 16), jnp.float32)
    weights = {"wi_up": jnp.zeros((4, 16, 32)), "wo": jnp.zeros((4, 32, 16))}
    with pytest.raises(ValueError, match="rows_up is only for two projections"):
        experts.expert_ffn(rows,
                           jnp.asarray([2, 2, 2, 2], jnp.int32),
                           weights,
                           cfg,
                           backend="xla",
                           rows_up=rows)


def test_expert_ffn_with_the_pair_equals_expert_ffn_on_the_rows():
    """The gated FFN on (rows, rows_up) from dispatch_rows_pair: output and every gradient
    (x through the permute, both weights) equal those of one dispatch_rows, within float32."""
    rng = np.random.default_rng(ref.seed())
    cfg = MoEConfig(d_model=16, d_ff=24, num_experts=4, top_k=2)
    t = 10
    x = jnp.asarray(rng.standard_normal((t, 16)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 4, (t, 2)), jnp.int32)
    d = sort.sort_copies(ids, jnp.ones((t, 2), bool), 4, jnp.zeros((), jnp.int32))
    w = {
        "wi_gate": jnp.asarray(rng.standard_normal((4, 16, 24)) * 0.2, jnp.float32),
        "wi_up": jnp.asarray(rng.standard_normal((4, 16, 24)) * 0.2, jnp.float32),
        "wo": jnp.asarray(rng.standard_normal((4, 24, 16)) * 0.2, jnp.float32),
    }
    cot = jnp.asarray(rng.standard_normal((t * 2, 16)), jnp.float32)

    def loss(a, wts, pair):
        if pair:
            rows, rows_up = sort.dispatch_rows_pair(a, d, backend="xla")
        else:
            rows, rows_up = sort.dispatch_rows(a, d, backend="xla"), None
        out = experts.expert_ffn(rows, d.group_sizes, wts, cfg, backend="xla", rows_up=rows_up)
        return jnp.sum(out * cot)

    for a, b in zip(
            jax.grad(loss, argnums=(0, 1))(x, w, True),
            jax.grad(loss, argnums=(0, 1))(x, w, False)):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert ref.rel_err(u, v) <= F32_TOL


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_lowered_block_backward_sums_gate_and_up_cotangents_in_the_unpermute(
        monkeypatch, fuse_gate_up):
    """moe_block's fwd+bwd lowered for CUDA on a faked Hopper: one index for all permutes; with
    separate gate and up projections the permute's backward is one indexed unpermute of both
    cotangents (no [R, M] add); with the fused gate/up GEMM (one read of the rows) of one."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    cfg = mp.MoEConfig(num_experts=8,
                       top_k=2,
                       d_model=64,
                       d_ff=128,
                       kernel_backend="cuda",
                       fuse_gate_up=fuse_gate_up)
    params = mp.init_moe_params(jax.random.key(ref.seed()), cfg)
    x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)

    def step(p, xx):
        return jax.grad(lambda a: jnp.sum(mp.moe_block(p, a, cfg).y.astype(jnp.float32)))(xx)

    text = cuda_module(jax.jit(step), params, x)
    targets = re.findall(r"custom_call @(moe_\w+)", text)
    assert targets.count("moe_permute_index") == 1, targets
    assert "moe_permute" not in targets and "moe_unpermute" not in targets, targets
    # (the combine's forward unpermute is not needed for d x: the permute's backward is the only
    # unpermute left)
    twos = re.findall(r"custom_call @moe_unpermute_indexed\(.*two = (true|false)", text)
    assert twos == ["false" if fuse_gate_up else "true"], twos


def test_permute_index_reference_is_the_csr_inverse_and_indexed_ops_equal_plain_ones():
    """The index's layout against NumPy, and the ops given it (the reference side on the CPU)
    equal to the ops without it, gradients too."""
    rng = np.random.default_rng(ref.seed())
    t = 17
    rm, x, c1, _ = _case(rng, t)
    row_map = jnp.asarray(rm)
    index = np.asarray(permute_index_reference(row_map, t))
    offsets, cursor, lists = ref.permute_index(rm, t)
    assert index.shape == (2 * t + 4 + len(rm), )
    np.testing.assert_array_equal(index[:t + 2], offsets)
    np.testing.assert_array_equal(index[t + 2:2 * t + 4], cursor)
    np.testing.assert_array_equal(index[2 * t + 4:], lists)
    assert ops.permute_index(row_map, t, backend="xla") is None  # no kernels: no index

    idx = permute_index_cuda(row_map, t)
    np.testing.assert_array_equal(permute_cuda(x, row_map, idx), permute_cuda(x, row_map))
    np.testing.assert_array_equal(unpermute_cuda(c1, row_map, t, idx),
                                  unpermute_cuda(c1, row_map, t))
    g1 = jax.grad(lambda a: jnp.sum(permute_cuda(a, row_map, idx) * c1))(x)
    g2 = jax.grad(lambda a: jnp.sum(permute_cuda(a, row_map) * c1))(x)
    np.testing.assert_array_equal(g1, g2)
