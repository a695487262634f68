"""Helpers of the expert-parallel tests (test_ep.py, test_ep_exchange.py,
test_ep_praxis_lm.py; also test_mesh_types.py, test_shared_experts.py, test_gate_up_moe.py): the
mesh matrix on the 8 CPU devices of tests/conftest.py, the config matrix, one jitted function for
the loss and gradients of several configs (and its one-device reference, the `matrix_case`
fixture), fast XLA:CPU compiles, skewed routing inputs and the comparisons at the shared
tolerance (1e-5 relative in float32; integer outputs equal)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis import moe as moe_lib
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


def sharded_block(cfg, mesh_name, kind, backend_name):
    """(fn, params, mesh, resources): moe_lib.sharded_fn of cfg on the mesh `mesh_name` with
    the exchange `kind`, for 64 tokens."""
    params = mp.init_moe_params(jax.random.key(0), cfg)
    mesh, res = make_mesh(mesh_name)
    fn = moe_lib.sharded_fn(cfg,
                            mp.ep_bootstrap(mesh, res, cfg.num_experts),
                            mesh,
                            kind=kind,
                            seq_len=None,
                            t_global=64,
                            param_names=tuple(params),
                            backend=backend_name)
    return fn, params, mesh, res
