"""Shared experts (MoEConfig.num_shared_experts): the whole block, routed + shared, against a
float64 reference, on one device and over the expert-parallel mesh matrix; the config's
validation; the parameter contract and the sharding of the shared weights.

Tolerances. One device against the float64 reference: 1e-5 relative (norm-wise); the block
computes in float32 (HIGHEST-precision products on XLA:CPU), so float32 rounding of sums over
d_model / d_ff terms (~1e-7 relative) is all that separates them. Meshes against one device:
1e-5 relative in float32, as tests/test_ep.py (only summation order differs: psums over tp
and over the token shards of a weight gradient).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from moe_praxis import params as params_lib
from tests import ep_util, kernel_reference
from tests.moe_reference import reference_decisions
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RTOL = 1e-5
D_MODEL, D_FF = 16, 8

# The shared-branch variants: gated or not, with or without Qwen2-MoE's gate, Hs default or set.
SHARED_OPTIONS = [
    dict(num_shared_experts=1),
    dict(num_shared_experts=2, shared_expert_gate=True),
    dict(num_shared_experts=1, shared_d_ff=12, gated=False, activation="gelu"),
    dict(num_shared_experts=3, gated=False, activation="relu", shared_expert_gate=True),
]


def _cfg(**kw):
    base = dict(d_model=D_MODEL, d_ff=D_FF, num_experts=8, top_k=2)
    base.update(kw)
    return mp.MoEConfig(**base)


def _act64(name):
    return {"silu": jax.nn.silu, "relu": jax.nn.relu, "gelu": jax.nn.gelu}[name]


def reference_block64(params, x, cfg, valid, decisions):
    """The whole block's y (routed + shared) in float64, dense: every expert on every token,
    masked by its combine weight. decisions: (ids [T, k], keep [T, k]) from NumPy float64
    (tests.moe_reference.reference_decisions). Call under jax.enable_x64(True)."""
    f64 = jnp.float64
    p = {k: jnp.asarray(v, f64) for k, v in params.items()}
    x2 = jnp.asarray(x, f64).reshape(-1, cfg.d_model)
    ids, keep = decisions
    logits = x2 @ p["router"]
    w = kernel_reference.weights_for_ids_for(logits, jnp.asarray(ids), cfg)
    w = w * jnp.asarray(keep, f64)
    dense_w = jnp.einsum("tk,tke->te", w, jax.nn.one_hot(ids, cfg.num_experts, dtype=f64))
    act = _act64(cfg.activation)
    y = jnp.zeros_like(x2)
    for e in range(cfg.num_experts):
        up = x2 @ p["wi_up"][e]
        h = act(x2 @ p["wi_gate"][e]) * up if cfg.gated else act(up)
        y = y + dense_w[:, e:e + 1] * (h @ p["wo"][e])
    if cfg.num_shared_experts:
        up = x2 @ p["shared_wi_up"]
        h = act(x2 @ p["shared_wi_gate"]) * up if cfg.gated else act(up)
        shared = h @ p["shared_wo"]
        if cfg.shared_expert_gate:
            shared = shared * jax.nn.sigmoid(x2 @ p["shared_gate"])
        y = y + shared
    return (y * jnp.asarray(valid, f64)[:, None]).reshape(x.shape)


def _inputs(cfg, seed, shape=(4, 16)):
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    params = mp.init_moe_params(k1, cfg)
    if "expert_bias" in params:
        params["expert_bias"] = 0.05 * jax.random.normal(k5, (cfg.num_experts, ))
    x = jax.random.normal(k2, shape + (cfg.d_model, ), jnp.float32)
    paddings = (jax.random.uniform(k3, shape) < 0.2).astype(jnp.float32)
    cot = jax.random.normal(k4, x.shape, jnp.float32)
    return params, x, paddings, cot


@pytest.mark.parametrize("opts",
                         SHARED_OPTIONS + [
                             dict(num_shared_experts=1,
                                  score_func="sigmoid",
                                  use_expert_bias=True,
                                  routed_scaling_factor=2.5),
                             dict(num_shared_experts=2, shared_expert_gate=True, fuse_gate_up=True),
                         ],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_block_with_shared_experts_equals_float64_reference(opts):
    """y and the gradients of sum(y * cot) (every parameter and x) against the float64 dense
    reference of routed + shared; padded tokens are exactly zero."""
    cfg = _cfg(**opts)
    seed = _seed()
    params, x, paddings, cot = _inputs(cfg, seed)
    valid = np.asarray(paddings).reshape(-1) < 0.5
    if cfg.fuse_gate_up:  # the routed experts' fused layout; the reference reads wi_gate/wi_up
        ref_params = dict(params)
        wgu = ref_params.pop("wi_gate_up")
        ref_params["wi_gate"], ref_params["wi_up"] = wgu[..., 0::2], wgu[..., 1::2]
    else:
        ref_params = params
    decisions = reference_decisions(x.reshape(-1, D_MODEL), ref_params, cfg, valid)

    def loss(p, x):
        o = mp.moe_block(p, x, cfg, paddings=paddings)
        return jnp.sum(o.y * cot), o

    (_, out), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    with jax.enable_x64(True):
        y64 = reference_block64(ref_params, x, cfg, valid, decisions)
        gp64, gx64 = jax.grad(
            lambda p, x: jnp.sum(reference_block64(p, x, cfg, valid, decisions) * cot),
            argnums=(0, 1))({
                k: np.asarray(v, np.float64)
                for k, v in ref_params.items()
            }, np.asarray(x, np.float64))
        y64, gx64 = np.asarray(y64), np.asarray(gx64)
        gp64 = {k: np.asarray(v) for k, v in gp64.items()}
    msg = f"seed={seed} cfg={cfg}"
    assert out.y.dtype == x.dtype and out.y.shape == x.shape
    assert rel_err(out.y, y64) < RTOL, msg
    np.testing.assert_array_equal(np.asarray(out.y).reshape(-1, D_MODEL)[~valid], 0.0, msg)
    assert rel_err(gx, gx64) < RTOL, f"dx {msg}"
    if cfg.fuse_gate_up:
        gp = dict(gp)
        g = gp.pop("wi_gate_up")
        gp["wi_gate"], gp["wi_up"] = g[..., 0::2], g[..., 1::2]
    for name in gp:
        if name == "expert_bias":  # selection only: no gradient by design
            assert float(jnp.max(jnp.abs(gp[name]))) == 0.0
            continue
        assert rel_err(gp[name], gp64[name]) < RTOL, f"d{name} {msg}"


def test_shared_branch_changes_the_output_and_zero_shared_weights_remove_it():
    """routed + shared: with the shared down projection zeroed the block is the routed block
    (same routed parameters), and with it the output differs by exactly the shared branch."""
    cfg = _cfg(num_shared_experts=1)
    plain = dataclasses.replace(cfg, num_shared_experts=0)
    params, x, paddings, _ = _inputs(cfg, _seed())
    routed = {k: v for k, v in params.items() if not k.startswith("shared_")}
    y_plain = mp.moe_block(routed, x, plain, paddings=paddings).y
    zeroed = dict(params, shared_wo=jnp.zeros_like(params["shared_wo"]))
    np.testing.assert_array_equal(np.asarray(mp.moe_block(zeroed, x, cfg, paddings=paddings).y),
                                  np.asarray(y_plain))
    y = mp.moe_block(params, x, cfg, paddings=paddings).y
    assert float(jnp.max(jnp.abs(y - y_plain))) > 1e-3


def test_param_shapes_and_init():
    cfg = _cfg(num_shared_experts=2, shared_expert_gate=True)
    shapes = params_lib.param_shapes(cfg)
    hs = 2 * D_FF
    assert cfg.shared_hidden == hs
    assert shapes["shared_wi_gate"] == (D_MODEL, hs) and shapes["shared_wi_up"] == (D_MODEL, hs)
    assert shapes["shared_wo"] == (hs, D_MODEL) and shapes["shared_gate"] == (D_MODEL, 1)
    ungated = params_lib.param_shapes(_cfg(num_shared_experts=1, shared_d_ff=5, gated=False))
    assert "shared_wi_gate" not in ungated and "shared_gate" not in ungated
    assert ungated["shared_wi_up"] == (D_MODEL, 5) and ungated["shared_wo"] == (5, D_MODEL)
    assert not any(k.startswith("shared") for k in params_lib.param_shapes(_cfg()))
    # fuse_gate_up fuses the routed experts only; the shared branch keeps its two projections
    fused = params_lib.param_shapes(_cfg(num_shared_experts=1, fuse_gate_up=True))
    assert {"shared_wi_gate", "shared_wi_up", "wi_gate_up"} <= set(fused)
    p = mp.init_moe_params(jax.random.key(_seed()), _cfg(num_shared_experts=64, d_ff=16))
    # fan-in init: std = 1 / sqrt(fan_in) (fan_in = d_model for wi, Hs for wo)
    assert abs(float(jnp.std(p["shared_wi_up"])) * math.sqrt(D_MODEL) - 1) < 0.05
    assert abs(float(jnp.std(p["shared_wo"])) * math.sqrt(64 * 16) - 1) < 0.05
    with pytest.raises(ValueError, match=r"missing \['shared_gate'\].*shared_expert_gate=True"):
        params_lib.check_params(
            {
                k: v
                for k, v in mp.init_moe_params(jax.random.key(0), cfg).items() if k != "shared_gate"
            }, cfg)
    bad = dict(mp.init_moe_params(jax.random.key(0), cfg))
    bad["shared_wo"] = bad["shared_wo"][:-1]
    with pytest.raises(ValueError, match=r"'shared_wo' has shape \(15, 16\).*\(16, 16\)"):
        params_lib.check_params(bad, cfg)


def test_shared_checkpoint_names_are_saved(capsys):
    """save_only_these_names with the shared branch's documented names (docs/config.md) saves
    residuals of exactly those names and shapes: the activation [T, Hs] and the output [T, M]
    (the loss sum(y^2) needs y in its backward)."""
    cfg = _cfg(num_shared_experts=1)
    params, x, _, _ = _inputs(cfg, _seed())
    policy = jax.checkpoint_policies.save_only_these_names("moe_shared_ffn1", "moe_shared_ffn2")
    f = jax.checkpoint(lambda p, x: jnp.sum(mp.moe_block(p, x, cfg).y**2), policy=policy)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(f, params, x)
    lines = capsys.readouterr().out.splitlines()
    named = {l.split(" from ")[0] for l in lines if "named '" in l}
    t = x.size // D_MODEL
    want = {
        f"f32[{t},{D_FF}] named 'moe_shared_ffn1'", f"f32[{t},{D_MODEL}] named 'moe_shared_ffn2'"
    }
    assert named == want, lines


@pytest.mark.parametrize("kw,match", [
    (dict(num_shared_experts=-1), r"num_shared_experts=-1 is invalid: must be an int >= 0"),
    (dict(num_shared_experts=1.0), r"num_shared_experts=1.0 is invalid"),
    (dict(num_shared_experts=True), r"num_shared_experts=True is invalid"),
    (dict(num_shared_experts=1, shared_d_ff=0), r"shared_d_ff=0 is invalid: must be a positive"),
    (dict(num_shared_experts=1, shared_d_ff=-4), r"shared_d_ff=-4 is invalid"),
    (dict(shared_d_ff=16), r"shared_d_ff=16 is invalid: needs num_shared_experts > 0"),
    (dict(shared_expert_gate=True), r"shared_expert_gate=True is invalid: needs "
     r"num_shared_experts > 0"),
])
def test_bad_shared_values_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_shared_weight_specs_are_a_dense_ffn():
    """tp on Hs, fsdp on d_model whatever fsdp_dim says, nothing over dp or ep; the gate
    replicated like the router."""
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "ep"), devices=jax.devices()[:8])
    for fsdp_dim in ("expert", "model"):
        res = mp.MeshResources(dp="dp", fsdp="fsdp", ep="ep", fsdp_dim=fsdp_dim)
        specs = mp.ep_bootstrap(mesh, res, 8).weight_specs
        assert specs["shared_wi_gate"] == P("fsdp", None) == specs["shared_wi_up"]
        assert specs["shared_wo"] == P(None, "fsdp") and specs["shared_gate"] == P(None, None)
    tp_mesh = jax.make_mesh((2, 4), ("tp", "ep"), devices=jax.devices()[:8])
    specs = mp.ep_bootstrap(tp_mesh, mp.MeshResources(tp="tp", ep="ep"), 8).weight_specs
    assert specs["shared_wi_up"] == P(None, "tp") and specs["shared_wo"] == P("tp", None)


def test_shared_sizes_the_mesh_cannot_split_are_named():
    mesh = jax.make_mesh((2, 4), ("tp", "fsdp"), devices=jax.devices()[:8])
    res = mp.MeshResources(tp="tp", fsdp="fsdp")
    with pytest.raises(ValueError, match=r"shared_d_ff=5 is not divisible by the tp size 2"):
        mp.ep_bootstrap(mesh, res, 8, d_model=16, d_ff=8, shared_d_ff=5)
    with pytest.raises(ValueError, match=r"d_model=6 is not divisible by the fsdp size 4"):
        mp.ep_bootstrap(mesh, res, 8, d_model=6, d_ff=8, shared_d_ff=8)
    mp.ep_bootstrap(mesh, res, 8, d_model=6, d_ff=8)  # no shared experts: d_model unsharded
    cfg = _cfg(num_shared_experts=1, shared_d_ff=5)
    params, x, _, _ = _inputs(cfg, 0)
    with pytest.raises(ValueError, match=r"shared_d_ff=5 is not divisible by the tp size 2"):
        mp.moe_block(params, x, cfg, mesh=mesh, resources=res)


# ----------------------------------------------------------------------- the mesh matrix

# name -> (mesh shape, mesh axis names, MeshResources kwargs)
MESHES = {
    "ep2": ((2, ), ("ep", ), dict(ep="ep")),
    "dp2xep2": ((2, 2), ("dp", "ep"), dict(dp="dp", ep="ep")),
    "fsdp2xep2": ((2, 2), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep")),
    "tp2xep2": ((2, 2), ("tp", "ep"), dict(tp="tp", ep="ep")),
    "dp2xfsdp2xep2": ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp", ep="ep")),
    "dp2xfsdp2xep2_fsdp_on_model":
    ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp", ep="ep", fsdp_dim="model")),
    "ep2xtp2xfsdp2": ((2, 2, 2), ("ep", "tp", "fsdp"), dict(ep="ep", tp="tp", fsdp="fsdp")),
}

MATRIX_CONFIGS = [
    _cfg(num_shared_experts=1, z_loss_coeff=1e-3),
    _cfg(num_shared_experts=2, shared_expert_gate=True, capacity_factor=0.5),
    _cfg(num_shared_experts=1,
         shared_d_ff=12,
         gated=False,
         activation="gelu",
         shared_expert_gate=True,
         score_func="sigmoid",
         use_expert_bias=True),
]


def _loss_and_grads(configs, mesh=None, resources=None):
    """One compiled function for all `configs`: per config (MoEOutput, (dparams, dx)) of the
    loss sum(y * cot) + aux_loss + z_loss, padded exchange under EP."""

    def f(all_params, x, paddings, cot):
        out = []
        for cfg, params in zip(configs, all_params):
            cfg = dataclasses.replace(cfg, ep_exchange="padded")

            def loss(p, x, cfg=cfg):
                o = mp.moe_block(p, x, cfg, mesh=mesh, resources=resources, paddings=paddings)
                return jnp.sum(o.y * cot) + o.aux_loss + o.z_loss, o

            (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
            out.append((o, grads))
        return out

    return ep_util._fast_jit(f)  # one fast compile per mesh (XLA:CPU compile time dominates)


@pytest.fixture(scope="module")
def matrix_case():
    seed = _seed()
    keys = jax.random.split(jax.random.key(seed), len(MATRIX_CONFIGS) + 1)
    all_params = [mp.init_moe_params(k, c) for c, k in zip(MATRIX_CONFIGS, keys)]
    for p, c, k in zip(all_params, MATRIX_CONFIGS, keys):
        if c.use_expert_bias:
            p["expert_bias"] = 0.05 * jax.random.normal(jax.random.fold_in(k, 1), (8, ))
    _, x, paddings, cot = _inputs(MATRIX_CONFIGS[0], int(seed) + 1)
    args = (all_params, x, paddings, cot)
    return seed, args, _loss_and_grads(MATRIX_CONFIGS)(*args)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_shared_experts_mesh_matrix_equals_single_device(mesh_name, matrix_case):
    seed, args, ref = matrix_case
    shape, names, kw = MESHES[mesh_name]
    devices = np.array(jax.devices("cpu")[:math.prod(shape)]).reshape(shape)
    mesh, res = Mesh(devices, names), mp.MeshResources(**kw)
    got = _loss_and_grads(MATRIX_CONFIGS, mesh, res)(*args)
    valid = np.asarray(args[2]).reshape(-1) < 0.5
    for g, r, cfg in zip(got, ref, MATRIX_CONFIGS):
        m = f"seed={seed} mesh={mesh_name} cfg={cfg}"
        ep_util._compare_one(g, r, m)  # y, aux loss, counts, drops, dx, every weight gradient
        (o, (gp, _)), (ro, (rp, _)) = g, r
        np.testing.assert_array_equal(np.asarray(o.y).reshape(-1, D_MODEL)[~valid], 0.0, m)
        assert abs(float(o.z_loss) - float(ro.z_loss)) <= RTOL * abs(float(ro.z_loss)), m
        assert set(gp) == set(rp) and any(k.startswith("shared_") for k in gp), m
        if "expert_bias" in gp:  # selection only: no gradient on either side
            assert float(jnp.max(jnp.abs(gp["expert_bias"]))) == 0.0, m


@pytest.mark.slow
def test_shared_experts_on_explicit_axes_with_weights_placed_by_the_layout(matrix_case):
    """Explicit mesh axes (jax.make_mesh) and every parameter placed with its
    EPLayout.weight_specs sharding (shared_wi_* P(fsdp, tp), shared_wo P(tp, fsdp)): the
    same outputs and gradients as one device."""
    seed, (all_params, x, paddings, cot), ref = matrix_case
    shape, names, kw = MESHES["ep2xtp2xfsdp2"]
    mesh = jax.make_mesh(shape,
                         names,
                         devices=jax.devices("cpu")[:math.prod(shape)],
                         axis_types=(jax.sharding.AxisType.Explicit, ) * len(shape))
    res = mp.MeshResources(**kw)
    specs = mp.ep_bootstrap(mesh, res, 8).weight_specs
    placed = [{
        k: jax.device_put(v, NamedSharding(mesh, specs[k]))
        for k, v in p.items()
    } for p in all_params]
    assert placed[1]["shared_wo"].sharding.spec == P("tp", "fsdp")
    got = _loss_and_grads(MATRIX_CONFIGS, mesh, res)(placed, x, paddings, cot)
    for g, r, cfg in zip(got, ref, MATRIX_CONFIGS):
        ep_util._compare_one(g, r, f"seed={seed} explicit ep2xtp2xfsdp2 cfg={cfg}")
