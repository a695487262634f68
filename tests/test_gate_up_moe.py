"""Fused gate/up in the MoE block (MoEConfig.fuse_gate_up, the wi_gate_up parameter): the config
and parameter contract, and moe_block with fused weights against the unfused block (the same
function) on one device, under the EP meshes of tests/ep_util.py (the XLA path, and the CUDA
backend's Python paths with the references in place of the FFI calls) and, on GPUs, with the
CUDA kernels on one device and under EP. The op itself: tests/test_gate_up.py.

Tolerances (norm-wise relative): float32 on the CPU 1e-5 (summation order only); bf16 with the
CUDA kernels 2e-2 (bf16 roundings of the intermediates at different points).
"""

import dataclasses
import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.moe import check_params
from moe_praxis.ops import backend as backend_mod
from tests import ep_util
from tests.grouped_gemm_util import _cuda_or_skip
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RTOL_F32 = 1e-5


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
    if forced_cuda:
        monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced"))
        gg = importlib.import_module("moe_praxis.ops.grouped_gemm")
        # float32 passes too, so the fused op takes its CUDA Python path (platform_call)
        monkeypatch.setattr(gg, "cuda_unsupported_reason", lambda lhs, rhs: None)
    seed = _seed()
    mesh, res = ep_util.make_mesh(mesh_name)
    cfgs = [
        mp.MoEConfig(d_model=ep_util.D_MODEL,
                     d_ff=ep_util.D_FF,
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
    params = [ep_util._params(c, kk) for c, kk in zip(cfgs, keys[:2])]
    x = jax.random.normal(keys[2], (ep_util.BATCH, ep_util.SEQ, ep_util.D_MODEL))
    cot = jax.random.normal(keys[3], x.shape)
    ref = ep_util._loss_and_grads(cfgs)(params, x, None, cot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float32 grouped GEMM's fallback warning
        got = ep_util._loss_and_grads(fused, mesh, res)([fuse_params(p) for p in params], x, None,
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
