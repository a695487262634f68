"""Fused gate/up + SwiGLU (ops.gate_up_swiglu, MoEConfig.fuse_gate_up).

Oracles: a float64 NumPy loop over groups (gate = lhs @ w[:, 0::2], up = lhs @ w[:, 1::2],
act = silu(gate) * up * w_row) and the unfused ops (grouped_gemm + swiglu) on the split weights.
Tolerances (norm-wise relative): float32 on the CPU 1e-5 (summation order only); bf16 on the
GPU 1e-2 (fp32 accumulation, bf16 roundings of gate, up and act: ~3 x 2^-9). The CUDA epilogue
computes act from the bf16-rounded gate and up exactly as the SwiGLU kernel does, so there it
must equal ops.swiglu(gate, up, w, backend='cuda') bitwise. Fresh random inputs each run.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.moe import check_params
from moe_praxis.ops import gate_up
from tests.test_grouped_gemm import KINDS, _cuda_or_skip, make_sizes
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
    from moe_praxis.ops import backend as backend_mod

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


def test_config_and_params_of_fuse_gate_up():
    with pytest.raises(ValueError, match="fuse_gate_up.*gated=True"):
        mp.MoEConfig(d_model=8, d_ff=16, num_experts=4, gated=False, fuse_gate_up=True)
    cfg = mp.MoEConfig(d_model=8, d_ff=16, num_experts=4, fuse_gate_up=True)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    assert params["wi_gate_up"].shape == (4, 8, 32)
    assert "wi_gate" not in params and "wi_up" not in params
    check_params(params, cfg)
    unfused = mp.init_moe_params(jax.random.key(0), dataclasses.replace(cfg, fuse_gate_up=False))
    with pytest.raises(ValueError, match="fuse_gate_up=True"):
        check_params(unfused, cfg)


def fuse_params(params):
    """Unfused params -> fuse_gate_up params of the same function."""
    out = {k: v for k, v in params.items() if k not in ("wi_gate", "wi_up")}
    out["wi_gate_up"] = ops.interleave_gate_up(params["wi_gate"], params["wi_up"])
    return out


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_moe_block_fused_equals_unfused(capacity):
    """The same function: y, losses and every gradient (wi_gate_up's = the interleaved
    gradients of wi_gate and wi_up), float32, dropless and with drops."""
    seed = _seed()
    cfg = mp.MoEConfig(d_model=16,
                       d_ff=24,
                       num_experts=8,
                       top_k=2,
                       capacity_factor=capacity,
                       kernel_backend="xla")
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (4, 16, 16))
    cot = jax.random.normal(k3, x.shape)

    def loss(p, x, c):
        o = mp.moe_block(p, x, c)
        return jnp.sum(o.y * cot) + o.aux_loss, o

    with jax.default_matmul_precision("highest"):
        (_, o), (gp, gx) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x, cfg)
        (_, of), (gpf,
                  gxf) = jax.value_and_grad(loss, (0, 1),
                                            has_aux=True)(fuse_params(params), x,
                                                          dataclasses.replace(cfg,
                                                                              fuse_gate_up=True))
    msg = f"seed={seed}"
    assert rel_err(of.y, o.y) < RTOL_F32, msg
    assert int(of.dropped_tokens) == int(o.dropped_tokens)
    assert rel_err(gxf, gx) < RTOL_F32, msg
    assert rel_err(gpf["wi_gate_up"], fuse_params(gp)["wi_gate_up"]) < RTOL_F32, msg
    for name in ("router", "wo"):
        assert rel_err(gpf[name], gp[name]) < RTOL_F32, f"{msg} d{name}"


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


@pytest.mark.gpu
def test_moe_block_fused_cuda_matches_unfused_cuda():
    _cuda_or_skip()
    seed = _seed()
    cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=128, d_ff=256, kernel_backend="cuda")
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (4, 96, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    fcfg = dataclasses.replace(cfg, fuse_gate_up=True)

    def loss(p, x, c):
        return jnp.sum(mp.moe_block(p, x, c).y.astype(jnp.float32)**2)

    f = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, fcfg), (0, 1)))
    assert "moe_grouped_gemm_swiglu_fwd" in f.lower(fuse_params(params), x).as_text()
    lf, (gpf, gxf) = f(fuse_params(params), x)
    l, (gp, gx) = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, cfg), (0, 1)))(params, x)
    msg = f"seed={seed}"
    assert abs(float(lf) - float(l)) <= 2e-2 * abs(float(l)), msg
    assert rel_err(gxf, gx) < 2e-2, msg
    assert rel_err(gpf["wi_gate_up"], fuse_params(gp)["wi_gate_up"]) < 2e-2, msg
    assert rel_err(gpf["wo"], gp["wo"]) < 2e-2, msg


@pytest.mark.parametrize("forced_cuda", [False, True])
@pytest.mark.parametrize("mesh_name", ["ep8", "ep2xtp2xdp2", "dp2xfsdp2xep2_fsdp_on_model"])
def test_fused_under_ep_meshes_equals_unfused_single_device(mesh_name, forced_cuda, monkeypatch):
    """moe_block with fuse_gate_up on EP meshes (wi_gate_up sharded like wi_up: experts over
    ep (+ fsdp), 2H over tp, whose shards hold whole units) against one device without it:
    y, losses and every gradient. forced_cuda: kernel_backend='cuda' with the CUDA status
    forced on (and float32 accepted), so every CUDA op's Python path (the fused op's
    custom_vjp, platform_call, vary_together) runs inside shard_map with the references in
    place of the FFI calls (as in test_ep)."""
    import importlib
    import warnings

    from moe_praxis.ops import backend as backend_mod
    from tests import test_ep

    if forced_cuda:
        monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced"))
        gg = importlib.import_module("moe_praxis.ops.grouped_gemm")
        # float32 passes too, so the fused op takes its CUDA Python path (platform_call)
        monkeypatch.setattr(gg, "cuda_unsupported_reason", lambda lhs, rhs: None)
    seed = _seed()
    mesh, res = test_ep.make_mesh(mesh_name)
    cfgs = [
        mp.MoEConfig(d_model=test_ep.D_MODEL,
                     d_ff=test_ep.D_FF,
                     num_experts=8,
                     top_k=k,
                     capacity_factor=cap,
                     z_loss_coeff=1e-3) for k, cap in ((2, None), (1, 0.5))
    ]
    fused = [
        dataclasses.replace(c, fuse_gate_up=True, kernel_backend="cuda" if forced_cuda else "xla")
        for c in cfgs
    ]
    keys = jax.random.split(jax.random.key(seed), 4)
    params = [test_ep._params(c, kk) for c, kk in zip(cfgs, keys[:2])]
    x = jax.random.normal(keys[2], (test_ep.BATCH, test_ep.SEQ, test_ep.D_MODEL))
    cot = jax.random.normal(keys[3], x.shape)
    ref = test_ep._loss_and_grads(cfgs)(params, x, None, cot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float32 grouped GEMM's fallback warning
        got = test_ep._loss_and_grads(fused, mesh, res)([fuse_params(p) for p in params], x, None,
                                                        cot)
    for cfg, (o, (gp, gx)), (ro, (rp, rx)) in zip(fused, got, ref):
        msg = f"seed={seed} mesh={mesh_name} cfg={cfg}"
        assert rel_err(o.y, ro.y) < RTOL_F32, msg
        assert abs(float(o.aux_loss) - float(ro.aux_loss)) <= RTOL_F32 * abs(float(ro.aux_loss))
        assert int(o.dropped_tokens) == int(ro.dropped_tokens), msg
        assert rel_err(gx, rx) < RTOL_F32, msg
        assert rel_err(gp["wi_gate_up"], fuse_params(rp)["wi_gate_up"]) < RTOL_F32, msg
        for name in ("router", "wo"):
            assert rel_err(gp[name], rp[name]) < RTOL_F32, f"{msg} d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["padded", "ragged"])
def test_gpu_fused_under_ep_equals_single_device(exchange):
    """On >= 2 GPUs, bf16, kernel_backend='cuda': moe_block with fuse_gate_up under EP (the
    fused kernels inside shard_map, forward and backward) against one device with the same
    kernels; and its compiled forward runs the fused kernel."""
    from jax.sharding import Mesh

    _cuda_or_skip()
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 GPUs, found {len(gpus)}")
    seed = _seed()
    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("ep", ))
    res = mp.MeshResources(ep="ep")
    cfg = mp.MoEConfig(d_model=128,
                       d_ff=256,
                       num_experts=4 * n,
                       top_k=2,
                       fuse_gate_up=True,
                       kernel_backend="cuda",
                       ep_exchange=exchange)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mp.init_moe_params(k1, cfg))
    x = jax.random.normal(k2, (2 * n, 64, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, x.shape, jnp.float32)

    def loss(p, x, mesh=None, resources=None):
        o = mp.moe_block(p, x, cfg, mesh=mesh, resources=resources)
        return jnp.sum(o.y.astype(jnp.float32) * cot) + o.aux_loss, o.y

    with jax.default_device(gpus[0]):
        (_, ry), (rp, rx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    f = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, mesh, res), (0, 1), has_aux=True))
    text = f.lower(params, x).as_text()
    assert "moe_grouped_gemm_swiglu_fwd" in text and "moe_swiglu_bwd_interleaved" in text
    (_, y), (gp, gx) = f(params, x)
    msg = f"seed={seed} exchange={exchange}"
    assert rel_err(y, ry) < 2e-2, msg
    assert rel_err(gx, rx) < 2e-2, msg
    for name in ("wi_gate_up", "wo", "router"):
        assert rel_err(gp[name], rp[name]) < 2e-2, f"{msg} d{name}"


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
