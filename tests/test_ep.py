"""Expert parallelism: every mesh layout computes the single-device moe_block.

On the 8 CPU devices of tests/conftest.py, for every mesh of the matrix below and all of
E in {8, 16} x k in {1, 2} x {dropless, capacity}: y, aux_loss, z_loss, tokens_per_expert,
dropped_tokens and the gradients of every parameter and of x equal one-device moe_block.
All eight configs of a mesh go through ONE jitted function (one compile per mesh), against a
one-device reference jitted once for the module.

Tolerance: 1e-5 relative (norm-wise) in float32. The sharded block computes the same
products; only summation order differs (psums over shards, per-shard partial sums of the
aux loss, rows regrouped by source rank), which moves float32 results by ~1e-7 relative.
Integer outputs (tokens_per_expert, dropped_tokens) must be equal.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis import moe as moe_lib
from moe_praxis.dispatch import exchange as exchange_lib
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RTOL = 1e-5
D_MODEL, D_FF = 16, 32
BATCH, SEQ = 4, 16  # 64 tokens: 8 per token shard on 8 devices

# name -> (mesh shape, mesh axis names, MeshResources kwargs)
MESHES = {
    "dp8": ((8, ), ("dp", ), dict(dp="dp")),
    "fsdp8": ((8, ), ("fsdp", ), dict(fsdp="fsdp")),
    "ep8": ((8, ), ("ep", ), dict(ep="ep")),
    "dp2xep4": ((2, 4), ("dp", "ep"), dict(dp="dp", ep="ep")),
    "fsdp2xep4": ((2, 4), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep")),
    "dp2xfsdp2xep2": ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp", ep="ep")),
    "dp4xep2": ((4, 2), ("dp", "ep"), dict(dp="dp", ep="ep")),
    "fsdp4xep2": ((4, 2), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep")),
    "dp2xfsdp2xep2_fsdp_on_model":
    ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp", ep="ep", fsdp_dim="model")),
    "ep2xtp2xdp2": ((2, 2, 2), ("ep", "tp", "dp"), dict(ep="ep", tp="tp", dp="dp")),
    "dp2xep(2x2)": ((2, 2, 2), ("dp", "ea", "eb"), dict(dp="dp", ep=("ea", "eb"))),
}


def make_mesh(name):
    shape, names, kw = MESHES[name]
    devices = np.array(jax.devices("cpu")[:math.prod(shape)]).reshape(shape)
    return Mesh(devices, names), mp.MeshResources(**kw)


def _configs():
    """E in {8, 16} x k in {1, 2} x {dropless, capacity}, with varied router options."""
    out = []
    for e in (8, 16):
        for k in (1, 2):
            for cap in (None, 0.5):  # 0.5: fewer slots than valid copies, so drops
                kw = dict(d_model=D_MODEL,
                          d_ff=D_FF,
                          num_experts=e,
                          top_k=k,
                          z_loss_coeff=1e-3,
                          capacity_factor=cap)
                if cap is not None and (e + k) % 2:  # half the capacity cases drop by weight
                    kw["drop_policy"] = "weight"
                if e == 16 and k == 2 and cap is None:  # DeepSeek-style router in the matrix
                    kw.update(score_func="sigmoid", use_expert_bias=True)
                out.append(mp.MoEConfig(**kw))
    return out


CONFIGS = _configs()


def _params(cfg, key):
    k1, k2 = jax.random.split(key)
    p = mp.init_moe_params(k1, cfg)
    if "expert_bias" in p:
        p["expert_bias"] = 0.05 * jax.random.normal(k2, (cfg.num_experts, ))
    return p


def _loss_and_grads(configs, mesh=None, resources=None):
    """One function for all `configs`: per config (MoEOutput, (dparams, dx)) of the loss
    sum(y * cot) + aux_loss + z_loss."""

    def one(cfg, params, x, paddings, cot):

        def loss(p, x):
            o = mp.moe_block(p, x, cfg, mesh=mesh, resources=resources, paddings=paddings)
            return jnp.sum(o.y * cot) + o.aux_loss + o.z_loss, o

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return out, grads

    def f(all_params, x, paddings, cot):
        return [one(c, p, x, paddings, cot) for c, p in zip(configs, all_params)]

    return _fast_jit(f)


# XLA:CPU compile time dominates these tests (tiny shapes). LLVM's optimisation level changes
# only the speed of the generated code, not what it computes.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _fast_jit(f):
    """jax.jit(f), compiled with _FAST_COMPILE on first call (one compile per wrapper)."""
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(jax.jit(f).lower(*args).compile(_FAST_COMPILE))
        return compiled[0](*args)

    return call


def _compare(got, ref, msg):
    for (o, (gp, gx)), (ro, (rp, rx)), cfg in zip(got, ref, CONFIGS):
        m = f"{msg} cfg={cfg}"
        assert rel_err(o.y, ro.y) < RTOL, m
        for name in ("aux_loss", "z_loss"):
            a, b = float(getattr(o, name)), float(getattr(ro, name))
            assert abs(a - b) <= RTOL * abs(b) + 1e-12, f"{m} {name}: {a} vs {b}"
        np.testing.assert_array_equal(np.asarray(o.tokens_per_expert),
                                      np.asarray(ro.tokens_per_expert),
                                      err_msg=m)
        assert int(o.dropped_tokens) == int(ro.dropped_tokens), m
        assert rel_err(gx, rx) < RTOL, f"{m} dx"
        for name in rp:
            if name == "expert_bias":  # selection only: no gradient on either side
                assert float(jnp.max(jnp.abs(gp[name]))) == 0.0, m
                continue
            assert rel_err(gp[name], rp[name]) < RTOL, f"{m} d{name}"


@pytest.fixture(scope="module")
def matrix_case():
    seed = _seed()
    keys = jax.random.split(jax.random.key(seed), len(CONFIGS) + 3)
    all_params = [_params(c, k) for c, k in zip(CONFIGS, keys)]
    x = jax.random.normal(keys[-3], (BATCH, SEQ, D_MODEL), jnp.float32)
    paddings = (jax.random.uniform(keys[-2], (BATCH, SEQ)) < 0.15).astype(jnp.float32)
    cot = jax.random.normal(keys[-1], x.shape, jnp.float32)
    ref = _loss_and_grads(CONFIGS)(all_params, x, paddings, cot)
    for (o, _), cfg in zip(ref, CONFIGS):  # the capacity cases really drop copies
        assert (int(o.dropped_tokens) > 0) == (cfg.capacity_factor is not None), cfg
    return seed, (all_params, x, paddings, cot), ref


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_mesh_matrix_equals_single_device(mesh_name, matrix_case):
    seed, args, ref = matrix_case
    mesh, res = make_mesh(mesh_name)
    got = _loss_and_grads(CONFIGS, mesh, res)(*args)
    _compare(got, ref, f"seed={seed} mesh={mesh_name}")


@pytest.mark.slow
@pytest.mark.parametrize("aux_loss_type", ["sequence", "gshard"])
def test_other_aux_losses_equal_single_device(aux_loss_type):
    seed = _seed()
    cfg = mp.MoEConfig(d_model=D_MODEL,
                       d_ff=D_FF,
                       num_experts=8,
                       top_k=2,
                       aux_loss_type=aux_loss_type,
                       aux_loss_coeff=0.1)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = _params(cfg, k1)
    # 8 sequences of 8 tokens: each of the 8 token shards holds one whole sequence.
    x = jax.random.normal(k2, (8, 8, D_MODEL), jnp.float32)
    paddings = (jax.random.uniform(k3, (8, 8)) < 0.2).astype(jnp.float32)
    mesh, res = make_mesh("dp2xfsdp2xep2")

    def aux(p, mesh=None, res=None):
        return mp.moe_block(p, x, cfg, mesh=mesh, resources=res, paddings=paddings).aux_loss

    ref, gref = _fast_jit(jax.value_and_grad(aux))(params)
    got, ggot = _fast_jit(jax.value_and_grad(lambda p: aux(p, mesh, res)))(params)
    assert abs(float(got) - float(ref)) <= RTOL * abs(float(ref)), f"seed={seed}"
    assert rel_err(ggot["router"], gref["router"]) < RTOL, f"seed={seed}"


def _skewed(cfg, seed, target_rank, ep):
    """Params and x where every token's top-k experts all belong to EP rank `target_rank`."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = _params(cfg, k1)
    per_rank = cfg.num_experts // ep
    owned = np.arange(target_rank * per_rank, (target_rank + 1) * per_rank)
    x = jax.random.normal(k2, (BATCH, SEQ, D_MODEL), jnp.float32)
    x = x.at[..., 0].set(4.0)  # a constant feature that the router maps onto `owned`
    params["router"] = params["router"].at[0, owned].add(5.0)
    return params, x, owned


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["ep8", "dp2xfsdp2xep2"])
def test_skewed_routing_to_one_rank_is_dropless(mesh_name):
    """Every copy goes to the experts of the last EP rank: the worst case the default
    buffers are sized for. Nothing is dropped and everything equals one device."""
    seed = _seed()
    mesh, res = make_mesh(mesh_name)
    ep = mp.ep_bootstrap(mesh, res, 16).ep_size
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=16, top_k=2)
    params, x, owned = _skewed(cfg, seed, ep - 1, ep)
    cot = jax.random.normal(jax.random.key(seed + 1), x.shape)
    ref = _loss_and_grads([cfg])([params], x, None, cot)
    got = _loss_and_grads([cfg], mesh, res)([params], x, None, cot)
    counts = np.asarray(got[0][0].tokens_per_expert)
    assert counts[owned].sum() == BATCH * SEQ * 2 and counts.sum() == BATCH * SEQ * 2, counts
    assert int(got[0][0].dropped_tokens) == 0
    _compare_one(got[0], ref[0], f"seed={seed} mesh={mesh_name}")


def _compare_one(got, ref, msg):
    (o, (gp, gx)), (ro, (rp, rx)) = got, ref
    assert rel_err(o.y, ro.y) < RTOL, msg
    assert abs(float(o.aux_loss) - float(ro.aux_loss)) <= RTOL * abs(float(ro.aux_loss)), msg
    np.testing.assert_array_equal(np.asarray(o.tokens_per_expert),
                                  np.asarray(ro.tokens_per_expert),
                                  err_msg=msg)
    assert int(o.dropped_tokens) == int(ro.dropped_tokens), msg
    assert rel_err(gx, rx) < RTOL, msg
    for name in rp:
        if name != "expert_bias":
            assert rel_err(gp[name], rp[name]) < RTOL, f"{msg} d{name}"


@pytest.mark.slow
def test_bounded_buffer_counts_overflow_and_never_writes_out_of_bounds():
    """ep_buffer_factor=2 on ep8: each device may send C = ceil(2 * R / 8) rows to one rank.
    With k=1 and every token routed to one expert, each device keeps its first C tokens (in
    token order) and drops the other Tl - C; dropped tokens get y = 0 and are counted."""
    seed = _seed()
    mesh, res = make_mesh("ep8")
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=1, ep_buffer_factor=2.0)
    params, x, owned = _skewed(cfg, seed, 5, 8)
    t_l = BATCH * SEQ // 8
    cap = exchange_lib.pair_capacity(t_l * 1, 8, 2.0)
    assert cap == 2
    out = _fast_jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res))(params, x)
    ref = mp.moe_block(params, x, mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=1))
    assert int(out.dropped_tokens) == 8 * (t_l - cap)
    kept = (np.arange(BATCH * SEQ) % t_l < cap).reshape(BATCH, SEQ, 1)
    np.testing.assert_array_equal(np.asarray(out.y)[~kept[..., 0]], 0.0)
    assert rel_err(np.where(kept, out.y, 0.0), np.where(kept, ref.y, 0.0)) < RTOL
    np.testing.assert_array_equal(np.asarray(out.tokens_per_expert),
                                  np.asarray(ref.tokens_per_expert))
    g = _fast_jit(
        jax.grad(lambda p: jnp.sum(mp.moe_block(p, x, cfg, mesh=mesh, resources=res).y**2)))(params)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


@pytest.mark.slow
def test_bounded_buffer_without_overflow_equals_single_device():
    """A bound the load stays under drops nothing: balanced routing with f = 8 on dp2xep4
    (C = R per pair, the worst case, so equality must be exact)."""
    seed = _seed()
    mesh, res = make_mesh("dp2xep4")
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, ep_buffer_factor=4.0)
    params = _params(cfg, jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, SEQ, D_MODEL))
    out = _fast_jit(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res))(params, x)
    ref = mp.moe_block(params, x, cfg)
    assert int(out.dropped_tokens) == 0
    assert rel_err(out.y, ref.y) < RTOL, f"seed={seed}"


@pytest.mark.slow
def test_all_tokens_padded_under_ep():
    """Every token padded (the empty case): nothing routes, every statistic is zero, y is
    zero and the gradients are finite, as on one device."""
    mesh, res = make_mesh("dp2xfsdp2xep2")
    cfg = mp.MoEConfig(d_model=D_MODEL,
                       d_ff=D_FF,
                       num_experts=8,
                       top_k=2,
                       z_loss_coeff=1e-3,
                       capacity_factor=1.0)
    params = _params(cfg, jax.random.key(_seed()))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D_MODEL))
    paddings = jnp.ones((BATCH, SEQ), jnp.float32)
    cot = jnp.ones_like(x)
    (out, (gp, gx)), = _loss_and_grads([cfg], mesh, res)([params], x, paddings, cot)
    assert float(jnp.max(jnp.abs(out.y))) == 0.0
    assert float(out.aux_loss) == 0.0 and float(out.z_loss) == 0.0
    assert int(jnp.sum(out.tokens_per_expert)) == 0 and int(out.dropped_tokens) == 0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves((gp, gx)))
    assert float(jnp.max(jnp.abs(gx))) == 0.0


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
def test_ragged_exchange_lowers_with_one_ragged_all_to_all_each_way():
    """XLA:CPU cannot compile ragged_all_to_all, so here the ragged path is traced and lowered
    (the GPU test below runs it)."""
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2, ep_exchange="ragged")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    mesh, res = make_mesh("dp2xfsdp2xep2")
    layout = mp.ep_bootstrap(mesh, res, 8)
    fn = moe_lib.sharded_fn(cfg,
                            layout,
                            mesh,
                            kind="ragged",
                            seq_len=None,
                            t_global=64,
                            param_names=tuple(params),
                            backend="xla")
    x, valid = jnp.ones((64, D_MODEL)), jnp.ones((64, ), bool)
    text = jax.jit(fn).lower(params, x, valid).as_text()
    assert text.count("ragged_all_to_all") == 2, text.count("ragged_all_to_all")
    # and its backward (the mirror moves of the cotangents) traces and lowers too
    grad = jax.grad(lambda p, x: jnp.sum(fn(p, x, valid)[0]**2), argnums=(0, 1))
    text = jax.jit(grad).lower(params, x).as_text()
    assert text.count("ragged_all_to_all") == 4, text.count("ragged_all_to_all")
    with pytest.raises(ValueError, match="ep_exchange='padded'"):
        mp.moe_block(params, jnp.ones((64, D_MODEL)), cfg, mesh=mesh, resources=res)


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


@pytest.mark.slow
def test_abstract_mesh_under_set_mesh():
    """Inside jit under jax.set_mesh a layer may only see the AbstractMesh; that is enough."""
    seed = _seed()
    mesh, res = make_mesh("dp2xfsdp2xep2")
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2)
    params = _params(cfg, jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, SEQ, D_MODEL))
    with jax.set_mesh(mesh):
        out = _fast_jit(lambda p, x: mp.moe_block(
            p, x, cfg, mesh=jax.sharding.get_abstract_mesh(), resources=res))(params, x)
    ref = mp.moe_block(params, x, cfg)
    assert rel_err(out.y, ref.y) < RTOL, f"seed={seed}"
    np.testing.assert_array_equal(np.asarray(out.tokens_per_expert),
                                  np.asarray(ref.tokens_per_expert))


def test_token_count_not_divisible_by_token_shards_raises():
    cfg = mp.MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=8)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    mesh, res = make_mesh("dp2xep4")
    with pytest.raises(ValueError, match="60 tokens .* not divisible by the 8 token shards"):
        mp.moe_block(params, jnp.ones((60, D_MODEL)), cfg, mesh=mesh, resources=res)
    with pytest.raises(ValueError, match="needs both mesh and resources"):
        mp.moe_block(params, jnp.ones((64, D_MODEL)), cfg, mesh=mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["fsdp8", "ep8", "ep2xtp2xdp2", "dp2xfsdp2xep2"])
def test_cuda_backend_python_paths_under_shard_map_equal_single_device(
        mesh_name, matrix_case, monkeypatch):
    """kernel_backend='cuda' with the CUDA status forced on: the CPU runs every CUDA op's
    Python path (custom_vjps, platform_call, vary_together) inside the EP shard_map, with the
    pure-JAX references in place of the FFI calls (float32: the grouped GEMM falls back), for
    the whole config matrix with paddings. Equal to one device with kernel_backend='xla'.
    (This reproduces, on the CPU, the SwiGLU custom_vjp's shard_map type error that 2 H200s
    showed before the fix.)"""
    import dataclasses
    import warnings

    from moe_praxis.ops import backend as backend_mod

    monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced by the test"))
    seed, args, ref = matrix_case
    mesh, res = make_mesh(mesh_name)
    cfgs = [dataclasses.replace(c, kernel_backend="cuda") for c in CONFIGS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float32 grouped GEMM's fallback warning
        got = _loss_and_grads(cfgs, mesh, res)(*args)
    _compare(got, ref, f"seed={seed} mesh={mesh_name} kernel_backend='cuda' (CPU references)")


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


# ----------------------------------------------------------------------------- Praxis LM


def _praxis_lm(resources, gating_func):
    """A small TransformerLm (2 layers, the second MoE with our layer) using `resources`."""
    from praxis import base_layer, pax_fiddle
    from praxis.layers import transformer_models, transformers

    moe = pax_fiddle.Config(mp.MoEFeedForward, mesh_resources=resources, router_z_loss_weight=1e-3)
    st = pax_fiddle.Config(transformers.StackedTransformer,
                           num_layers=2,
                           moe_layers=[1],
                           model_dims=D_MODEL,
                           hidden_dims=24,
                           num_heads=2,
                           num_experts=8,
                           num_groups=1,
                           gating_func=gating_func,
                           moe_layer_tpl=moe)
    tpl = pax_fiddle.Config(transformer_models.TransformerLm,
                            name="lm",
                            model_dims=D_MODEL,
                            vocab_size=32,
                            stacked_transformer_tpl=st)
    return base_layer.instantiate(tpl)


@pytest.mark.slow
@pytest.mark.parametrize("gating_func", ["dense_top2", "top2"])
def test_praxis_lm_train_step_same_loss_on_dp8_and_dp2xfsdp2xep2(gating_func):
    """A training step of a small Praxis LM (MoEFeedForward with mesh_resources, under
    jax.set_mesh): the loss before and after one Adam update (so the gradients too) is the
    same on dp8 and on dp2 x fsdp2 x ep2. 'top2' is GShard's capacity gating, which under EP
    applies one capacity to the global batch, as on one device."""
    import optax
    from praxis import base_layer, py_utils

    seed = _seed()
    b, l, v = 8, 8, 32  # 64 tokens: 8 per token shard
    k1, k2 = jax.random.split(jax.random.key(seed))
    inp = jax.random.randint(k1, (b, l), 0, v)
    tgt = jax.random.randint(k2, (b, l), 0, v)
    pad = jnp.zeros((b, l), jnp.float32).at[-1, l - 3:].set(1.0)
    labels = py_utils.NestedMap(class_ids=tgt, class_weights=1.0 - pad)

    def run(mesh_name):
        mesh, res = make_mesh(mesh_name)
        lm = _praxis_lm(res, gating_func)
        with base_layer.JaxContext.new_context():
            params = _fast_jit(lambda k: lm.init(k, inp, pad, labels=labels))(
                jax.random.key(seed + 1))["params"]
        opt = optax.adam(1e-2)

        def loss_fn(p):
            with base_layer.JaxContext.new_context():
                out, _ = lm.apply({"params": p},
                                  inp,
                                  pad,
                                  labels=labels,
                                  mutable=[base_layer.AUX_LOSS, base_layer.SUMMARIES])
            return out.total_loss

        def two_steps(p):
            loss0, g = jax.value_and_grad(loss_fn)(p)
            updates, _ = opt.update(g, opt.init(p), p)
            return loss0, loss_fn(optax.apply_updates(p, updates))

        with jax.set_mesh(mesh):
            return _fast_jit(two_steps)(params)

    ref = run("dp8")
    got = run("dp2xfsdp2xep2")
    for a, r in zip(got, ref):
        assert abs(float(a) - float(r)) <= RTOL * abs(float(r)), (
            f"seed={seed} {gating_func}: {[float(g) for g in got]} vs {[float(g) for g in ref]}")
    assert abs(float(ref[1]) - float(ref[0])) > 1e-3  # the update changed the loss
