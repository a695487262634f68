"""Fused gate/up + SwiGLU, the op (ops.gate_up_swiglu): interleaving and splitting the weights,
the XLA path, input checks, the CUDA backend's fallbacks, the CUDA kernels on the GPU and the
rule that picks their tile. The block with MoEConfig.fuse_gate_up: tests/test_gate_up_moe.py.

Oracles: a float64 NumPy loop over groups (gate = lhs @ w[:, 0::2], up = lhs @ w[:, 1::2],
act = silu(gate) * up * w_row) and the unfused ops (grouped_gemm + swiglu) on the split weights.
Tolerances (norm-wise relative): float32 on the CPU 1e-5 (summation order only); bf16 on the
GPU 1e-2 (fp32 accumulation, bf16 roundings of gate, up and act: ~3 x 2^-9). The CUDA epilogue
computes act from the bf16-rounded gate and up exactly as the SwiGLU kernel does, so there it
must equal ops.swiglu(gate, up, w, backend='cuda') bitwise. Fresh random inputs each run.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_praxis import ops
from moe_praxis.ops import backend as backend_mod
from moe_praxis.ops import gate_up
from tests.grouped_gemm_util import KINDS, _cuda_or_skip, make_sizes
from tests.testutil import rel_err
from tests.testutil import seed as _seed

swiglu_mod = importlib.import_module("moe_praxis.ops.swiglu")  # ops.swiglu is the function

RTOL_F32 = 1e-5
RTOL_BF16 = 1e-2


def _silu(x):
    return x / (1.0 + np.exp(-x))


def loop_reference(lhs, w_gu, gs, w_row=None):
    """float64 (gate, up, act) [M, H] each; rows past sum(gs) zero."""
    lhs = np.asarray(lhs, np.float64)
    w_gu = np.asarray(w_gu, np.float64)
    m, h = lhs.shape[0], w_gu.shape[2] // 2
    gate, up = np.zeros((m, h)), np.zeros((m, h))
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        rows = slice(start, start + size)
        gate[rows] = lhs[rows] @ w_gu[e][:, 0::2]
        up[rows] = lhs[rows] @ w_gu[e][:, 1::2]
        start += size
    act = _silu(gate) * up
    if w_row is not None:
        act = act * np.asarray(w_row, np.float64)[:, None]
    return gate, up, act


def _inputs(m, k, h, e, kind, dtype, seed):
    rng = np.random.default_rng(seed)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    w_gu = (jax.random.normal(k2, (e, k, 2 * h), jnp.float32) / np.sqrt(k)).astype(dtype)
    w_row = jax.random.uniform(k3, (m, ), jnp.float32, 0.1, 1.0)
    dact = jax.random.normal(k4, (m, h), jnp.float32).astype(dtype)
    return lhs, w_gu, jnp.asarray(make_sizes(kind, m, e, rng)), w_row, dact


def _unfused(lhs, w_gu, gs, w_row, backend):
    wg, wu = ops.split_gate_up(w_gu)
    gate = ops.grouped_gemm(lhs, wg, gs, backend=backend)
    up = ops.grouped_gemm(lhs, wu, gs, backend=backend)
    return ops.swiglu(gate, up, w_row, backend=backend)


# ------------------------------------------------------------------ CPU / every platform


def test_interleave_and_split_are_inverse_and_check_shapes():
    a = jnp.arange(24.0).reshape(2, 3, 4)
    b = -a
    w = ops.interleave_gate_up(a, b)
    assert w.shape == (2, 3, 8)
    np.testing.assert_array_equal(w[..., 0::2], a)
    np.testing.assert_array_equal(w[..., 1::2], b)
    g, u = ops.split_gate_up(w)
    np.testing.assert_array_equal(g, a)
    np.testing.assert_array_equal(u, b)
    with pytest.raises(ValueError, match="one shape"):
        ops.interleave_gate_up(a, b[..., :2])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_groups", "sum_lt_m"])
def test_xla_forward_and_grads_match_loop_and_unfused(kind, weighted):
    seed = _seed()
    lhs, w_gu, gs, w_row, dact = _inputs(37, 16, 12, 5, kind, jnp.float32, seed)
    w_row = w_row if weighted else None
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"
    with jax.default_matmul_precision("highest"):
        fused = lambda a, b, w: ops.gate_up_swiglu(a, b, gs, w, backend="xla")  # noqa: E731
        unfused = lambda a, b, w: _unfused(a, b, gs, w, "xla")  # noqa: E731
        out, vjp = jax.vjp(fused, lhs, w_gu, w_row)
        ref_out, ref_vjp = jax.vjp(unfused, lhs, w_gu, w_row)
        grads, ref_grads = vjp(dact), ref_vjp(dact)
    assert rel_err(out, loop_reference(lhs, w_gu, gs, w_row)[2]) < RTOL_F32, msg
    assert rel_err(out, ref_out) < RTOL_F32, msg
    total = int(np.asarray(gs).sum())
    np.testing.assert_array_equal(np.asarray(out[total:]), 0.0, err_msg=msg)
    for name, g, r in zip(("dlhs", "dw_gate_up", "dweights"), grads, ref_grads):
        if r is None:
            assert g is None, name
            continue
        assert rel_err(g, r) < RTOL_F32, f"{msg} {name}"


def test_bad_inputs_raise_clear_errors():
    lhs = jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"w_gate_up \[E,K,2H\]"):
        ops.gate_up_swiglu(lhs, jnp.ones((2, 5, 6)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="must be even"):
        ops.gate_up_swiglu(lhs, jnp.ones((2, 4, 5)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match=r"group_sizes must be \[E=2\]"):
        ops.gate_up_swiglu(lhs, jnp.ones((2, 4, 6)), jnp.array([8]))
    with pytest.raises(ValueError, match=r"row_weights must be \[M=8\]"):
        ops.gate_up_swiglu(lhs, jnp.ones((2, 4, 6)), jnp.array([4, 4]), jnp.ones(7))


def test_cuda_backend_falls_back_with_a_warning_naming_the_reason(monkeypatch):
    """With the CUDA status forced on (as on a Hopper GPU), problems the fused kernel does not
    take run the XLA path, warning once per reason: a non-silu activation, H % 8 != 0 and
    float32 inputs. The result is the reference's."""
    monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced"))
    backend_mod.reset_warnings()  # once per reason: a fresh record for this test
    gs = jnp.array([5, 3])
    cases = [
        (jnp.bfloat16, 8, "gelu", r"act='gelu'"),
        (jnp.bfloat16, 12, "silu", r"H % 8 == 0, got H=12"),
        (jnp.float32, 8, "silu", r"takes bf16 lhs and rhs"),
    ]
    for dtype, h, act, match in cases:
        lhs = jax.random.normal(jax.random.key(0), (8, 16)).astype(dtype)
        w_gu = jax.random.normal(jax.random.key(1), (2, 16, 2 * h)).astype(dtype)
        with pytest.warns(UserWarning, match=match):
            out = ops.gate_up_swiglu(lhs, w_gu, gs, act=act, backend="cuda")
        ref = gate_up.gate_up_swiglu_reference(lhs, w_gu, gs, act=act)[2]
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


# ------------------------------------------------------------------------ GPU (CUDA path)

GPU_SHAPES = [(1000, 136, 200, 8), (777, 64, 104, 5)]  # (M, K, H, E): H % 8 == 0, 2H % 16


@pytest.mark.gpu
@pytest.mark.parametrize("tile,split", [(t, 0) for t in gate_up.FUSED_TILES] + [(4, 256)])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_fused_forward_matches_reference(kind, tile, split):
    """gate, up and act against the float64 loop; act bitwise equal to the SwiGLU kernel on
    the kernel's own gate and up; tails zero; outputs poisoned by an earlier call. split: the
    row split (pieces of 256 rows: the epilogue finds each piece's first row)."""
    _cuda_or_skip()
    gg = gate_up.gg
    config = gg.config_name(tile, 0, 1, split)
    for m, k, h, e in GPU_SHAPES:
        for weighted in (False, True):
            seed = _seed()
            lhs, w_gu, gs, w_row, _ = _inputs(m, k, h, e, kind, jnp.bfloat16, seed)
            ww = w_row if weighted else swiglu_mod.no_weights()
            f = jax.jit(lambda a, b, g, w: gate_up.cuda_fwd(a, b, g, w, weighted, config))
            jax.block_until_ready(f(lhs * 2 + 1, w_gu + 1, gs[::-1], ww + 1))  # poison
            gate, up, act = f(lhs, w_gu, gs, ww)
            msg = f"seed={seed} kind={kind} tile={config} shape={(m, k, h, e)} w={weighted}"
            ref = loop_reference(lhs, w_gu, gs, w_row if weighted else None)
            for name, got, r in zip(("gate", "up", "act"), (gate, up, act), ref):
                assert got.dtype == jnp.bfloat16 and got.shape == (m, h), name
                assert np.isfinite(np.asarray(got, np.float32)).all(), f"{msg} {name}"
                assert rel_err(got, r) < RTOL_BF16, f"{msg} {name}"
                total = int(np.asarray(gs).sum())
                np.testing.assert_array_equal(np.asarray(got[total:], np.float32),
                                              0.0,
                                              err_msg=f"{msg} {name}")
            same = ops.swiglu(gate, up, w_row if weighted else None, backend="cuda")
            np.testing.assert_array_equal(np.asarray(act, np.float32),
                                          np.asarray(same, np.float32),
                                          err_msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_groups", "sum_lt_m"])
def test_cuda_fused_grads_match_unfused(kind, weighted):
    """Gradients of the fused op (kernels: fused fwd, interleaved SwiGLU bwd, one dgrad, one
    wgrad) against the unfused CUDA ops' and the float32 XLA path's; empty experts get zero."""
    _cuda_or_skip()
    m, k, h, e = 1000, 136, 200, 8
    seed = _seed()
    lhs, w_gu, gs, w_row, dact = _inputs(m, k, h, e, kind, jnp.bfloat16, seed)
    w_row = w_row if weighted else None
    msg = f"seed={seed} kind={kind} weighted={weighted} sizes={np.asarray(gs)}"
    fused = jax.jit(lambda a, b, w, d: jax.vjp(
        lambda a, b, w: ops.gate_up_swiglu(a, b, gs, w, backend="cuda"), a, b, w)[1](d))
    text = fused.lower(lhs, w_gu, w_row, dact).as_text()
    for target in ("moe_grouped_gemm_swiglu_fwd", "moe_swiglu_bwd_interleaved",
                   "moe_grouped_gemm_dgrad", "moe_grouped_gemm_wgrad"):
        assert target in text, target
    jax.block_until_ready(fused(lhs + 1, w_gu * 2, w_row, dact + 1))  # poison
    got = fused(lhs, w_gu, w_row, dact)
    with jax.default_matmul_precision("highest"):
        f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
        _, ref_vjp = jax.vjp(lambda a, b, w: ops.gate_up_swiglu(a, b, gs, w, backend="xla"),
                             f32(lhs), f32(w_gu), w_row)
        ref = ref_vjp(f32(dact))
    for name, g, r in zip(("dlhs", "dw_gate_up", "dweights"), got, ref):
        if r is None:
            continue
        assert rel_err(g, r) < 2 * RTOL_BF16, f"{msg} {name}"
    empty = np.asarray(gs) == 0
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[empty], 0.0, err_msg=msg)


def test_fused_config_rule_follows_the_forward_rule(monkeypatch):
    """choose_fused_config: the plain forward's rule, its tile replaced by FUSED_STANDIN's
    where the fused kernel lacks it (none of the rule's tiles: the rule's configuration is kept
    whole); the same for a tile MOE_PRAXIS_GG_TILE names (docs/grouped_gemm.md, "Fused
    gate/up")."""
    gg = gate_up.gg
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    assert set(gate_up.FUSED_STANDIN.values()) <= set(gate_up.FUSED_TILES)
    assert set(gate_up.FUSED_STANDIN) | set(gate_up.FUSED_TILES) == set(range(len(gg.TILE_CONFIGS)))
    assert not set(gate_up.FUSED_STANDIN) & set(gate_up.FUSED_TILES)
    for m, k, n, e in ((32768, 4096, 28672, 8), (32768, 7168, 4096, 32), (65536, 2048, 1536, 128),
                       (8192, 2048, 1536, 128)):
        plain = gg.parse_config(gg.choose_config("fwd", m, k, n, e))
        fused = gg.parse_config(gate_up.choose_fused_config(m, k, n, e))
        assert fused[1:] == plain[1:] and fused[0] in gate_up.FUSED_TILES
        assert fused[0] == gate_up.FUSED_STANDIN.get(plain[0], plain[0])
        assert fused == plain  # the rule's tiles are all built fused
    mid = gg.TILE_CONFIGS.index("pingpong_128x192_c1x1")
    assert gg.parse_config(gate_up.choose_fused_config(65536, 2048, 1536, 128))[0] == mid
    assert gg.parse_config(gate_up.choose_fused_config(8192, 2048, 1536, 128))[0] == 10
    assert gg.parse_config(gate_up.choose_fused_config(32768, 4096, 28672, 8))[0] == mid
    monkeypatch.setenv(gg.ENV_TILE, "pingpong_64x256_c2x1/along_n")  # -> its adaptive pair
    assert gate_up.choose_fused_config(32768, 4096, 28672, 8) == gg.config_name(4, 1, 1)
    monkeypatch.setenv(gg.ENV_TILE, "coop_256x128_c2x1/along_n")
    assert gate_up.choose_fused_config(32768, 4096, 28672, 8) == gg.config_name(2, 1, 1)
    monkeypatch.setenv(gg.ENV_TILE, "adaptive_128x256_64x256_c1x2/along_m/s1/r512")
    assert gate_up.choose_fused_config(8, 8, 8, 1) == gg.config_name(4, 0, 1, 512)
    monkeypatch.setenv(gg.ENV_TILE, "pingpong_128x128_c2x1")
    assert gate_up.choose_fused_config(32768, 4096, 28672, 8) == gg.config_name(1, 0, 1)
    with pytest.raises(ValueError, match="not built"):
        gate_up.cuda_fwd(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16),
                         jnp.array([4, 4]), jnp.zeros((1, )), False, gg.config_name(0))
