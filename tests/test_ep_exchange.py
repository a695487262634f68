"""The expert-parallel exchange: buffer sizes, the choice of exchange by platform and override,
the collectives of the compiled block on the 8 CPU devices of tests/conftest.py (one all-to-all
of token rows each way, all-gathers of expert weights only, fsdp weight gradients
reduce-scattered), the ragged exchange lowered (XLA:CPU cannot compile it), and on >= 2 GPUs both
exchanges against one device (dropless, skewed, bounded overflow) and the ep-size-1 path with the
CUDA kernels.

Tolerance against one device: 1e-5 relative in float32 (only summation order differs; the GPU
runs at 'highest' matmul precision); integer outputs are equal.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis.dispatch import exchange as exchange_lib
from tests.ep_util import (BATCH, D_FF, D_MODEL, SEQ, _compare_one, _loss_and_grads, _params,
                           _skewed, make_mesh, sharded_block)
from tests.grouped_gemm_util import _fake_device, cuda_module
from tests.testutil import seed as _seed


def test_buffer_sizes():
    # worst case: a device may send all R copies to one rank; a rank may receive ep * R.
    assert exchange_lib.pair_capacity(16, 8) == 16
    assert exchange_lib.recv_capacity(16, 8) == 128
    # bounded: f x the balanced load, never more than the worst case, at least one row
    assert exchange_lib.pair_capacity(16, 8, 1.0) == 2
    assert exchange_lib.pair_capacity(16, 8, 1.5) == 3
    assert exchange_lib.pair_capacity(16, 8, 100.0) == 16
    assert exchange_lib.recv_capacity(16, 8, 1.5) == 24
    assert exchange_lib.recv_capacity(16, 8, 100.0) == 128
    assert exchange_lib.pair_capacity(3, 8, 0.01) == 1


def _compiled_collectives(hlo: str):
    """{op: [[(dtype, dims), ...] per instruction]} for all-to-all and all-gather."""
    ops = {"all-to-all": [], "all-gather": []}
    for line in hlo.splitlines():
        for op in ops:
            if f" {op}(" in line and "=" in line:
                result = line.split("=", 1)[1].split(f" {op}(", 1)[0]
                shapes = re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", result)
                ops[op].append([(d, tuple(int(v) for v in dims.split(",") if v))
                                for d, dims in shapes])
    return ops


@pytest.mark.slow
def test_padded_exchange_hlo_is_one_all_to_all_each_way():
    """Forward on ep8 (dropless, padded): exactly two all-to-alls move token rows (f32 with
    d_model columns: one out, one back), the others carry the [ep, El] int32 counts and the
    [ep, C] float32 routing weights of the rows (multiplied into the experts' activation),
    and nothing is all-gathered. On dp2 x fsdp2 x ep2 the all-gathers are the expert
    weights (rank-3 f32 [E/ep/fsdp, ., .]) only, never tokens."""
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, ep_exchange="padded")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jnp.ones((BATCH * SEQ, D_MODEL))
    for name in ("ep8", "dp2xfsdp2xep2"):
        mesh, res = make_mesh(name)
        f = jax.jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res).y)
        ops = _compiled_collectives(f.lower(params, x).compile().as_text())
        a2a = ops["all-to-all"]
        rows = [
            i for i in a2a if all(d == "f32" and len(s) == 3 and s[-1] == D_MODEL for d, s in i)
        ]
        counts = [i for i in a2a if all(d == "s32" for d, _ in i)]
        row_w = [i for i in a2a if all(d == "f32" and len(s) == 2 for d, s in i)]
        assert len(rows) == 2 and len(counts) == 1 and len(row_w) == 1 and len(a2a) == 4, a2a
        if name == "ep8":
            assert ops["all-gather"] == [], ops
        else:
            assert ops["all-gather"], ops
            for inst in ops["all-gather"]:
                for d, s in inst:
                    assert d == "f32" and len(s) == 3 and sorted(s[1:]) == [D_MODEL, D_FF], ops


@pytest.mark.slow
def test_fsdp_weight_gradients_are_reduce_scattered():
    """fsdp2 x ep4: the three expert weights are all-gathered over fsdp in the forward and
    their gradients reduce-scattered back to the [E/(ep*fsdp), ., .] shards (no all-reduce of
    expert-weight gradients)."""
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    mesh, res = make_mesh("fsdp2xep4")
    grad = jax.jit(
        jax.grad(lambda p, x: jnp.sum(mp.moe_block(p, x, cfg, mesh=mesh, resources=res).y**2)))
    hlo = grad.lower(params, jnp.ones((64, D_MODEL))).compile().as_text()
    shapes = {
        op: re.findall(rf"= (f32\[[0-9,]*\])\S* {op}\(", hlo)
        for op in ("reduce-scatter", "all-gather", "all-reduce")
    }
    assert sorted(shapes["reduce-scatter"]) == ["f32[1,16,32]", "f32[1,16,32]", "f32[1,32,16]"]
    assert sorted(shapes["all-gather"]) == ["f32[2,16,32]", "f32[2,16,32]", "f32[2,32,16]"]
    assert not [s for s in shapes["all-reduce"] if s.count(",") == 2], shapes


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["dp2xfsdp2xep2", "ep2xtp2xdp2"])
def test_ragged_exchange_lowers_with_one_ragged_all_to_all_each_way(mesh_name):
    """XLA:CPU cannot compile ragged_all_to_all, so here the ragged path is traced and lowered
    (the GPU test below runs it). With tp the experts' outputs vary over tp too: the return
    move (and its backward) must be typed so."""
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, ep_exchange="ragged")
    fn, params, mesh, res = sharded_block(cfg, mesh_name, "ragged", "xla")
    x, valid = jnp.ones((64, D_MODEL)), jnp.ones((64, ), bool)
    text = jax.jit(fn).lower(params, x, valid).as_text()
    assert text.count("ragged_all_to_all") == 2, text.count("ragged_all_to_all")
    # and its backward (the mirror moves of the cotangents) traces and lowers too
    grad = jax.grad(lambda p, x: jnp.sum(fn(p, x, valid)[0]**2), argnums=(0, 1))
    text = jax.jit(grad).lower(params, x).as_text()
    assert text.count("ragged_all_to_all") == 4, text.count("ragged_all_to_all")
    with pytest.raises(ValueError, match="ep_exchange='padded'"):
        mp.moe_block(params, jnp.ones((64, D_MODEL)), cfg, mesh=mesh, resources=res)


@pytest.mark.parametrize("kind", ["padded", "ragged"])
@pytest.mark.parametrize("mesh_name", ["ep8", "dp2xfsdp2xep2", "ep2xtp2xdp2"])
def test_exchange_lowered_for_cuda_builds_one_permute_index(monkeypatch, kind, mesh_name):
    """fwd+bwd of the sharded block lowered for CUDA (faked Hopper): the exchange's permute, its
    combine and their backwards read one permute index (moe_permute_index once; no permute or
    unpermute building its own), and the copies and the received rows are sorted by the sort
    kernels (the dispatch's and the regroup's moe_expert_sort), with no XLA sort."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, kernel_backend="cuda")
    fn, params, _, _ = sharded_block(cfg, mesh_name, kind, "cuda")
    x, valid = jnp.ones((64, D_MODEL), jnp.bfloat16), jnp.ones((64, ), bool)
    grad = jax.grad(lambda p, xx: jnp.sum(fn(p, xx, valid)[0].astype(jnp.float32)**2),
                    argnums=(0, 1))
    text = cuda_module(jax.jit(grad), params, x)
    targets = re.findall(r"custom_call @(moe_\w+)", text)
    assert targets.count("moe_permute_index") == 1, targets
    assert "moe_permute" not in targets and "moe_unpermute" not in targets, targets
    assert targets.count("moe_permute_indexed") == 2 and targets.count("moe_unpermute_indexed") == 2
    assert targets.count("moe_expert_sort") == 2 and "stablehlo.sort" not in text


class _FakeDevice:

    def __init__(self, platform):
        self.platform = platform


class _FakeMesh:

    def __init__(self, platform):
        self.devices = np.array([_FakeDevice(platform)] * 2)


def test_exchange_selection_by_platform_and_override():
    cfg = mp.MoEConfig(d_model=8, d_ff=8, num_experts=4)
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("cpu")) == "padded"
    # GPU: padded up to PADDED_GPU_MAX_EP (XLA:GPU's ragged_all_to_all is the slow one there)
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("gpu")) == "padded"
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("gpu"), 8) == "padded"
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("gpu"), 16) == "ragged"
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("tpu")) == "ragged"
    assert exchange_lib.exchange_kind(cfg, _FakeMesh("cpu"), 64) == "padded"
    forced = mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, ep_exchange="padded")
    assert exchange_lib.exchange_kind(forced, _FakeMesh("gpu")) == "padded"
    assert exchange_lib.exchange_kind(cfg, make_mesh("ep8")[0]) == "padded"
    abstract = jax.sharding.AbstractMesh((2, 4), ("dp", "ep"))  # what jit sees under set_mesh
    assert exchange_lib.mesh_platform(abstract) == jax.default_backend()
    with pytest.raises(ValueError, match="ep_exchange='scatter'"):
        mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, ep_exchange="scatter")
    with pytest.raises(ValueError, match="ep_buffer_factor=0"):
        mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, ep_buffer_factor=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["xla", "cuda"])
@pytest.mark.parametrize("exchange", ["ragged", "padded"])
def test_gpu_exchanges_equal_single_device(exchange, backend):
    """On >= 2 GPUs (ep over all of them): dropless, skewed and bounded-overflow cases; with
    kernel_backend='cuda' the CUDA kernels run inside shard_map, forward and backward."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 GPUs, found {len(gpus)}")
    if backend == "cuda" and not mp.ops.backend_info()["cuda"]["usable"]:
        pytest.skip(f"CUDA kernels not usable: {mp.ops.backend_info()['cuda']['reason']}")
    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("ep", ))
    res = mp.MeshResources(ep="ep")
    seed = _seed()
    cfg = mp.MoEConfig(d_model=D_MODEL,
                       d_ff=D_FF,
                       num_experts=2 * n,
                       top_k=2,
                       ep_exchange=exchange,
                       kernel_backend=backend)
    # float32 dots at full precision: on the GPU the default precision rounds their inputs to
    # TF32, so the one-device reference (weights multiplied into the activation) and the
    # 'ragged' exchange (weights applied after the return trip) differed by ~3e-4 (measured).
    with jax.default_matmul_precision("highest"):
        for skew in (False, True):
            if skew:
                params, x, _ = _skewed(cfg, seed, n - 1, n)
            else:
                params = _params(cfg, jax.random.key(seed))
                x = jax.random.normal(jax.random.key(seed + 1), (n, SEQ, D_MODEL))
            cot = jax.random.normal(jax.random.key(seed + 2), x.shape)
            with jax.default_device(gpus[0]):
                ref = _loss_and_grads([cfg])([params], x, None, cot)
            got = _loss_and_grads([cfg], mesh, res)([params], x, None, cot)
            _compare_one(got[0], ref[0], f"seed={seed} exchange={exchange} skew={skew}")
    # the compiled forward moves token rows with exactly one exchange each way
    params = _params(cfg, jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (n, SEQ, D_MODEL))
    hlo = jax.jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res).y).lower(
        params, x).compile().as_text()
    op = "ragged-all-to-all" if exchange == "ragged" else "all-to-all"
    moves = [
        l for l in hlo.splitlines()  # sync ops, or the start of async ones
        if re.search(rf"= .*f32\[[0-9,]*,{D_MODEL}\].* {op}(-start)?\(", l)
    ]
    assert len(moves) == 2, [l for l in hlo.splitlines() if op in l]
    # bounded buffer with everything on one rank: counted overflow, y = 0 for dropped tokens
    cfg = mp.MoEConfig(d_model=D_MODEL,
                       d_ff=D_FF,
                       num_experts=2 * n,
                       top_k=1,
                       ep_exchange=exchange,
                       ep_buffer_factor=1.0,
                       kernel_backend=backend)
    params, x, _ = _skewed(cfg, seed, 0, n)
    x = x[:n]
    out = jax.jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res))(params, x)
    t_l = x.shape[0] * x.shape[1] // n
    if exchange == "padded":
        kept_per_device = np.full(n, exchange_lib.pair_capacity(t_l, n, 1.0))
    else:  # the receiver's buffer of B rows fills in source-rank order
        b = exchange_lib.recv_capacity(t_l, n, 1.0)
        kept_per_device = np.clip(b - t_l * np.arange(n), 0, t_l)
    assert int(out.dropped_tokens) == int(np.sum(t_l - kept_per_device)), kept_per_device
    assert bool(jnp.all(jnp.isfinite(out.y)))


@pytest.mark.gpu
def test_gpu_one_device_mesh_weights_in_swiglu_equal_no_mesh():
    """ep size 1 without tp (a 1-GPU fsdp mesh) with kernel_backend='cuda': the routing
    weights go into the SwiGLU kernel inside shard_map and the combine is a plain unpermute;
    loss, outputs and gradients equal moe_block without a mesh on the same GPU."""
    gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
    if not gpus or not mp.ops.backend_info()["cuda"]["usable"]:
        pytest.skip(f"needs a GPU with the CUDA kernels: {mp.ops.backend_info()['cuda']}")
    mesh = Mesh(np.array(gpus[:1]), ("fsdp", ))
    res = mp.MeshResources(fsdp="fsdp")
    seed = _seed()
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, kernel_backend="cuda")
    params = _params(cfg, jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, SEQ, D_MODEL))
    cot = jax.random.normal(jax.random.key(seed + 2), x.shape)
    with jax.default_matmul_precision("highest"):
        ref = _loss_and_grads([cfg])([params], x, None, cot)
        got = _loss_and_grads([cfg], mesh, res)([params], x, None, cot)
        _compare_one(got[0], ref[0], f"seed={seed}")
        text = jax.jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res).y).lower(
            params, x).as_text()
    assert "moe_swiglu_fwd" in text and "moe_unpermute" in text, "the CUDA kernels ran"
