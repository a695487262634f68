"""SwiGLU + down projection with dSwiGLU in the dgrad epilogue (ops.swiglu_down,
ops.gate_up_swiglu_down, kernels/grouped_gemm_dswiglu.cu; MoEConfig.fuse_swiglu_bwd).

Oracles: a float64 NumPy loop over groups (dact = dout @ wo[e]^T, then the SwiGLU backward with
the routing weight) and the unfused composition (the dgrad grouped GEMM, then the SwiGLU
backward kernel). Tolerances (norm-wise relative): float32 on the CPU 1e-5 (summation order
only); bf16 on the GPU 1e-2 (fp32 accumulation, bf16 roundings of dact and of each output: a few
x 2^-9). On the GPU the kernel rounds dact to bf16 as the unfused dgrad stores it and then
computes kernels/swiglu.cu's expressions, so dgate, dup and act must equal the unfused CUDA
composition bitwise (same tile configuration, so the same accumulators); dw (float32 sums in
another order) to 1e-5. Fresh random inputs each run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops import backend as backend_mod
from moe_praxis.ops import dswiglu as sd
from moe_praxis.ops.swiglu import no_weights, swiglu_bwd_ffi
from tests.grouped_gemm_util import KINDS, _cuda_or_skip, make_sizes
from tests.testutil import rel_err
from tests.testutil import seed as _seed

gg = sd.gg
RTOL_F32 = 1e-5
RTOL_BF16 = 1e-2


def _silu(x):
    return x / (1.0 + np.exp(-x))


def loop_reference(dout, wo, gs, gate, up, w_row=None):
    """float64 (dgate, dup, act, dw); rows past sum(gs) zero."""
    dout, wo = np.asarray(dout, np.float64), np.asarray(wo, np.float64)
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    m, h = g.shape
    dact = np.zeros((m, h))
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        dact[start:start + size] = dout[start:start + size] @ wo[e].T
        start += size
    w = np.ones(m) if w_row is None else np.asarray(w_row, np.float64)
    s = 1.0 / (1.0 + np.exp(-g))
    dgate = dact * w[:, None] * u * s * (1.0 + g * (1.0 - s))
    dup = dact * w[:, None] * _silu(g)
    act = _silu(g) * u * w[:, None]
    act[start:] = 0.0
    return dgate, dup, act, (dact * _silu(g) * u).sum(1)


def _inputs(m, h, n, e, kind, dtype, seed):
    rng = np.random.default_rng(seed)
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    gate = jax.random.normal(k1, (m, h), jnp.float32).astype(dtype)
    up = jax.random.normal(k2, (m, h), jnp.float32).astype(dtype)
    wo = (jax.random.normal(k3, (e, h, n), jnp.float32) / np.sqrt(h)).astype(dtype)
    w_row = jax.random.uniform(k4, (m, ), jnp.float32, 0.1, 1.0)
    dout = jax.random.normal(k5, (m, n), jnp.float32).astype(dtype)
    return gate, up, wo, w_row, dout, jnp.asarray(make_sizes(kind, m, e, rng))


def _split(grads, interleaved):
    return ops.split_gate_up(grads) if interleaved else grads


# ------------------------------------------------------------------ CPU / every platform


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["skewed", "one_takes_all", "empty_groups", "sum_lt_m"])
def test_reference_matches_float64_loop(kind, weighted, interleaved):
    seed = _seed()
    gate, up, wo, w_row, dout, gs = _inputs(37, 16, 24, 5, kind, jnp.float32, seed)
    w = w_row if weighted else no_weights()
    with jax.default_matmul_precision("highest"):
        grads, act, dw = sd.dswiglu_dgrad_reference(dout,
                                                    wo,
                                                    gs,
                                                    gate,
                                                    up,
                                                    w,
                                                    has_weight=weighted,
                                                    interleaved=interleaved)
    ref = loop_reference(dout, wo, gs, gate, up, w_row if weighted else None)
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"
    for name, got, r in zip(("dgate", "dup", "act"), (*_split(grads, interleaved), act), ref):
        assert rel_err(got, r) < RTOL_F32, f"{msg} {name}"
    if weighted:
        assert rel_err(dw, ref[3]) < RTOL_F32, msg


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_custom_vjp_equals_the_unfused_composition(fused_gate_up, weighted):
    """The fused ops' custom_vjp (traced with the CUDA branch; its reference runs here) against
    the unfused ops on backend 'xla': output and every gradient, empty experts included."""
    seed = _seed()
    m, k, h, n, e = 41, 16, 8, 24, 6
    gate, up, wo, w_row, dout, gs = _inputs(m, h, n, e, "empty_groups", jnp.float32, seed)
    lhs = jax.random.normal(jax.random.key(seed + 1), (m, k))
    w_gu = jax.random.normal(jax.random.key(seed + 2), (e, k, 2 * h)) / np.sqrt(k)
    w = w_row if weighted else None

    def fused(*a):
        if fused_gate_up:
            return sd.fused_gate_up_swiglu_down(a[0], a[1], a[2], gs, a[3])
        return sd.fused_swiglu_down(a[0], a[1], a[3], gs, a[2])

    def unfused(*a):
        if fused_gate_up:
            act = ops.gate_up_swiglu(a[0], a[1], gs, a[3], backend="xla")
            return ops.grouped_gemm(act, a[2], gs, backend="xla")
        return ops.grouped_gemm(ops.swiglu(a[0], a[1], a[2], backend="xla"),
                                a[3],
                                gs,
                                backend="xla")

    args = (lhs, w_gu, wo, w) if fused_gate_up else (gate, up, w, wo)
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(fused, *args)
        ref_out, ref_vjp = jax.vjp(unfused, *args)
        grads, ref_grads = vjp(dout), ref_vjp(dout)
    msg = f"seed={seed} fused_gate_up={fused_gate_up} weighted={weighted}"
    assert rel_err(out, ref_out) < RTOL_F32, msg
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if r is None:
            assert g is None, f"{msg} grad {i}"
            continue
        assert rel_err(g, r) < RTOL_F32, f"{msg} grad {i}"


def test_public_ops_fall_back_to_the_unfused_ops_bitwise():
    """Where the fused kernel cannot run (here: backend 'xla'), swiglu_down and
    gate_up_swiglu_down are the unfused ops, bitwise, forward and backward."""
    gate, up, wo, w_row, dout, gs = _inputs(30, 8, 16, 4, "skewed", jnp.float32, _seed())
    assert sd.fused_reason(gate, wo, "xla") == "kernel_backend='xla'"
    f = lambda g, u, o, w: ops.swiglu_down(g, u, o, gs, w, backend="xla")  # noqa: E731
    r = lambda g, u, o, w: ops.grouped_gemm(  # noqa: E731
        ops.swiglu(g, u, w, backend="xla"), o, gs, backend="xla")
    a, va = jax.vjp(f, gate, up, wo, w_row)
    b, vb = jax.vjp(r, gate, up, wo, w_row)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, y in zip(va(dout), vb(dout)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="configures the fused kernel"):
        ops.swiglu_down(gate, up, wo, gs, config="coop_128x256_c2x1", backend="xla")
    with pytest.raises(ValueError, match=r"wo must be \[E, H=8, N\]"):
        ops.swiglu_down(gate, up, wo[:, :4], gs)


def test_fused_reason_names_what_rules_the_kernel_out(monkeypatch):
    """With CUDA forced usable (as on a Hopper GPU): '' for bf16 silu with H, N % 8 == 0; else
    the reason (activation, dtype, H; the sm_80 family)."""
    monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced"))
    monkeypatch.setattr(backend_mod,
                        "grouped_gemm_kernel",
                        lambda cc=None, dtype=None: ("sm90", "forced"))
    bf = jnp.bfloat16
    g = jax.ShapeDtypeStruct((64, 16), bf)
    assert sd.fused_reason(g, jax.ShapeDtypeStruct((4, 16, 32), bf), "cuda") == ""
    assert "act='gelu'" in sd.fused_reason(g, jax.ShapeDtypeStruct((4, 16, 32), bf), "cuda", "gelu")
    assert "bf16" in sd.fused_reason(jax.ShapeDtypeStruct((64, 16), jnp.float32),
                                     jax.ShapeDtypeStruct((4, 16, 32), jnp.float32), "cuda")
    assert "H=12" in sd.fused_reason(jax.ShapeDtypeStruct((64, 12), bf),
                                     jax.ShapeDtypeStruct((4, 12, 32), bf), "cuda")
    monkeypatch.setattr(backend_mod,
                        "grouped_gemm_kernel",
                        lambda cc=None, dtype=None: ("sm80", "forced sm80"))
    assert "sm_80" in sd.fused_reason(g, jax.ShapeDtypeStruct((4, 16, 32), bf), "cuda")


def test_config_rule_and_partials():
    """The dgrad rule's configuration with the fused forward's stand-ins; dw's partials are
    ceil(H / tile width) float32 per row (the kernel computes the same from its tile)."""
    for m, h, n, e in ((131072, 768, 2048, 128), (65536, 2048, 7168, 256), (32768, 14336, 4096, 8)):
        cfg = sd.choose_config(m, h, n, e)
        plain = gg.parse_config(gg.choose_config("dgrad", m, h, n, e))
        assert gg.parse_config(cfg)[0] in sd.FUSED_TILES and gg.parse_config(cfg)[1:] == plain[1:]
    assert sd.tile_width("pingpong_128x192_c1x1") == 192
    assert sd.tile_width("adaptive_128x256_64x256_c1x1") == 256
    assert sd.partial_bytes(1000, 768, "pingpong_128x192_c1x1", True) == 16128
    assert sd.partial_bytes(1000, 200, "coop_128x256_c2x1", True) == 4096
    assert sd.partial_bytes(1000, 768, "pingpong_128x192_c1x1", False) == 0


def test_block_flag_is_the_same_function_on_cpu():
    """MoEConfig.fuse_swiglu_bwd on the xla backend: moe_block's output and gradients equal
    the default's bitwise (the unfused ops run); the flag needs a gated, non-FP8 block."""
    with pytest.raises(ValueError, match="fuse_swiglu_bwd"):
        mp.MoEConfig(d_model=8, d_ff=16, num_experts=4, gated=False, fuse_swiglu_bwd=True)
    cfg = mp.MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2, kernel_backend="xla")
    params = mp.init_moe_params(jax.random.key(_seed()), cfg)
    x = jax.random.normal(jax.random.key(1), (24, 16))

    def loss(p, c):
        return jnp.sum(mp.moe_block(p, x, c).y**2)

    on = dataclasses.replace(cfg, fuse_swiglu_bwd=True)
    for a, b in zip(jax.tree.leaves(jax.value_and_grad(loss)(params, cfg)),
                    jax.tree.leaves(jax.value_and_grad(loss)(params, on))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------ GPU (CUDA path)

GPU_SHAPES = [(1000, 200, 136, 8), (777, 104, 64, 5)]  # (M, H, N, E): H % 8 == 0, M odd


@pytest.mark.gpu
@pytest.mark.parametrize("tile,split", [(t, 0) for t in sd.FUSED_TILES] + [(4, 256)])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_dswiglu_matches_float64_and_the_unfused_kernels(kind, tile, split):
    """Every output against the float64 loop; dgate, dup, act bitwise equal to the unfused
    kernels (dgrad with the same configuration, then moe_swiglu_bwd(_interleaved); act: the
    SwiGLU forward kernel), dw to 1e-5; rows past the sum zero; outputs poisoned by an
    earlier call with other inputs. split: the row split (the epilogue finds each piece's
    first row)."""
    _cuda_or_skip()
    config = gg.config_name(tile, 0, 1, split)
    for m, h, n, e in GPU_SHAPES:
        for weighted in (False, True):
            for interleaved in (False, True):
                seed = _seed()
                gate, up, wo, w_row, dout, gs = _inputs(m, h, n, e, kind, jnp.bfloat16, seed)
                w = w_row if weighted else no_weights()
                kw = dict(has_weight=weighted, interleaved=interleaved, config=config)
                f = jax.jit(lambda *a: sd.cuda_dswiglu_dgrad(*a, **kw))
                jax.block_until_ready(f(dout * 2 + 1, wo + 1, gs[::-1], up, gate, w + 1))
                grads, act, dw = f(dout, wo, gs, gate, up, w)
                msg = (f"seed={seed} kind={kind} config={config} shape={(m, h, n, e)} "
                       f"weighted={weighted} interleaved={interleaved}")
                ref = loop_reference(dout, wo, gs, gate, up, w_row if weighted else None)
                total = int(np.asarray(gs).sum())
                outs = (*_split(grads, interleaved), act)
                for name, got, r in zip(("dgate", "dup", "act"), outs, ref):
                    assert got.dtype == jnp.bfloat16 and got.shape == (m, h), f"{msg} {name}"
                    assert np.isfinite(np.asarray(got, np.float32)).all(), f"{msg} {name}"
                    assert rel_err(got, r) < RTOL_BF16, f"{msg} {name}"
                    np.testing.assert_array_equal(np.asarray(got[total:], np.float32),
                                                  0.0,
                                                  err_msg=f"{msg} {name}")
                dact = gg.cuda_dgrad(dout, wo, gs, config)
                unf = swiglu_bwd_ffi(gate, up, w, dact, weighted, interleaved=interleaved)
                same = (unf[0], ) if interleaved else unf[:2]
                for got, want in zip((grads, ) if interleaved else grads, same):
                    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                                  np.asarray(want, np.float32),
                                                  err_msg=msg)
                fwd = ops.swiglu(gate, up, w_row if weighted else None, backend="cuda")
                np.testing.assert_array_equal(np.asarray(act[:total], np.float32),
                                              np.asarray(fwd[:total], np.float32),
                                              err_msg=msg)
                if weighted:
                    assert dw.shape == (m, ) and rel_err(dw, ref[3]) < RTOL_BF16, msg
                    assert rel_err(dw[:total], unf[-1][:total]) < RTOL_F32, msg
                    np.testing.assert_array_equal(np.asarray(dw[total:]), 0.0, err_msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_cuda_block_with_fuse_swiglu_bwd_matches_the_unfused_block(fuse_gate_up):
    """moe_block (bf16, 'cuda') with fuse_swiglu_bwd: the fused kernel in the backward, no
    SwiGLU backward kernel; output and gradients against the block without it (and skewed
    routing: a router biased to one expert)."""
    _cuda_or_skip()
    cfg = mp.MoEConfig(d_model=128,
                       d_ff=200,
                       num_experts=8,
                       top_k=2,
                       kernel_backend="cuda",
                       fuse_gate_up=fuse_gate_up)
    seed = _seed()
    params = mp.init_moe_params(jax.random.key(seed), cfg, jnp.bfloat16)
    params["router"] = params["router"].at[:, 3].add(0.5)
    # with fuse_gate_up init_moe_params makes wi_gate_up [E, M, 2H] itself
    assert ("wi_gate_up" in params) == fuse_gate_up, sorted(params)
    x = jax.random.normal(jax.random.key(seed + 1), (999, 128), jnp.bfloat16)

    def grads(c):
        f = jax.jit(
            jax.value_and_grad(
                lambda p, xx: jnp.sum(mp.moe_block(p, xx, c).y.astype(jnp.float32)**2), (0, 1)))
        return f, f(params, x)

    on = dataclasses.replace(cfg, fuse_swiglu_bwd=True)
    f_on, got = grads(on)
    text = f_on.lower(params, x).as_text()
    assert sd.TARGETS[fuse_gate_up] in text and "moe_swiglu_bwd" not in text
    _, ref = grads(cfg)
    msg = f"seed={seed} fuse_gate_up={fuse_gate_up}"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert rel_err(a, b) < 2 * RTOL_BF16, msg
