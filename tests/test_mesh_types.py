"""Every kind of mesh JAX users make: `jax.make_mesh` (Explicit axes, its default), Auto axes
(`jax.sharding.Mesh`, tests/ep_util.py), a mix of both, and an AbstractMesh, for moe_block
and MoEFeedForward, with `jax.set_mesh` and without, on plain and sharded inputs.

On the 8 CPU devices of tests/conftest.py the outputs and gradients equal one-device
moe_block (tests/ep_util.py's config matrix and reference). Tolerance: 1e-5 relative in
float32, as in tests/test_ep.py (only summation orders differ); integer outputs are equal.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from tests import ep_util
from tests import praxis_layer_util as tpl_lib
from tests.ep_util import matrix_case  # noqa: F401  (the shared fixture)
from tests.testutil import rel_err
from tests.testutil import seed as _seed


def explicit_mesh(name, types=None):
    """tests/ep_util.py's mesh `name` built by jax.make_mesh (Explicit axes unless `types`)."""
    shape, names, kw = ep_util.MESHES[name]
    types = types or (AxisType.Explicit, ) * len(shape)
    mesh = jax.make_mesh(shape,
                         names,
                         devices=jax.devices("cpu")[:math.prod(shape)],
                         axis_types=types)
    return mesh, mp.MeshResources(**kw)


def _placed(args, mesh, res):
    """The matrix inputs with shardings: each config's parameters by the layout's weight
    specs, x and paddings over the first token axis on the batch dimension."""
    all_params, x, paddings, cot = args
    placed = []
    for cfg, p in zip(ep_util.CONFIGS, all_params):
        specs = mp.ep_bootstrap(mesh, res, cfg.num_experts).weight_specs
        placed.append({k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()})
    first = res.token_axes[0]
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(first)))
    return placed, put(x), put(paddings), put(cot)


# (mesh, under jax.set_mesh, inputs placed with shardings)
CASES = [
    ("ep8", False, False),
    ("dp2xfsdp2xep2", True, True),
    ("dp2xfsdp2xep2", False, True),
    ("ep2xtp2xdp2", True, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name,set_mesh,sharded", CASES)
def test_explicit_mesh_matrix_equals_single_device(mesh_name, set_mesh, sharded, matrix_case):
    seed, args, ref = matrix_case
    mesh, res = explicit_mesh(mesh_name)
    if sharded:
        args = _placed(args, mesh, res)
    f = ep_util._loss_and_grads(ep_util.CONFIGS, mesh, res)
    if set_mesh:
        with jax.set_mesh(mesh):
            got = f(*args)
    else:
        got = f(*args)
    ep_util._compare(
        got, ref, f"seed={seed} mesh={mesh_name} Explicit set_mesh={set_mesh} sharded={sharded}")
    if sharded:  # y keeps x's type: its sharding on the batch dimension
        y = got[0][0].y
        assert y.sharding.is_equivalent_to(args[1].sharding, y.ndim), y.sharding


def _one_config():
    cfg = mp.MoEConfig(d_model=ep_util.D_MODEL,
                       d_ff=ep_util.D_FF,
                       num_experts=8,
                       top_k=2,
                       z_loss_coeff=1e-3,
                       capacity_factor=1.0)
    seed = _seed()
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = ep_util._params(cfg, k1)
    x = jax.random.normal(k2, (ep_util.BATCH, ep_util.SEQ, ep_util.D_MODEL), jnp.float32)
    cot = jax.random.normal(k3, x.shape, jnp.float32)
    ref = ep_util._loss_and_grads([cfg])([params], x, None, cot)
    return cfg, seed, (params, x, cot), ref


@pytest.mark.slow
def test_mixed_axis_types_and_eager_equal_single_device():
    """A mesh mixing Explicit and Auto axes (fsdp Auto), under jax.set_mesh and jitted; and
    an all-Explicit mesh called eagerly (no jit, no jax.set_mesh)."""
    cfg, seed, (params, x, cot), ref = _one_config()
    mixed = (AxisType.Explicit, AxisType.Auto, AxisType.Explicit)
    mesh, res = explicit_mesh("dp2xfsdp2xep2", mixed)
    with jax.set_mesh(mesh):
        got = ep_util._loss_and_grads([cfg], mesh, res)([params], x, None, cot)
    ep_util._compare_one(got[0], ref[0], f"seed={seed} mixed axis types")
    mesh, res = explicit_mesh("dp4xep2")
    out = mp.moe_block(params, x, cfg, mesh=mesh, resources=res)
    assert rel_err(out.y, ref[0][0].y) < ep_util.RTOL, f"seed={seed} eager"
    np.testing.assert_array_equal(np.asarray(out.tokens_per_expert),
                                  np.asarray(ref[0][0].tokens_per_expert))


@pytest.mark.slow
def test_explicit_abstract_mesh_under_set_mesh():
    """Inside jit under jax.set_mesh of an Explicit mesh a layer may only see its
    AbstractMesh (Explicit axes too); x sharded over dp and fsdp on two dimensions."""
    cfg, seed, (params, x, cot), ref = _one_config()
    mesh, res = explicit_mesh("dp2xfsdp2xep2")
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("dp", "fsdp"))
        got = ep_util._fast_jit(lambda p, x: mp.moe_block(
            p, x, cfg, mesh=jax.sharding.get_abstract_mesh(), resources=res))(params, xs)
    assert rel_err(got.y, ref[0][0].y) < ep_util.RTOL, f"seed={seed}"
    assert got.y.sharding.is_equivalent_to(xs.sharding, 3), got.y.sharding


def test_mesh_types_are_read_into_the_layout():
    res = mp.MeshResources(dp="dp", ep="ep")
    explicit = jax.sharding.AbstractMesh((2, 4), ("dp", "ep"),
                                         axis_types=(AxisType.Explicit, AxisType.Explicit))
    # AbstractMesh's default axis types differ across JAX versions: name them
    auto = jax.sharding.AbstractMesh((2, 4), ("dp", "ep"),
                                     axis_types=(AxisType.Auto, AxisType.Auto))
    mixed = jax.sharding.AbstractMesh((2, 4), ("dp", "ep"),
                                      axis_types=(AxisType.Auto, AxisType.Explicit))
    assert mp.ep_bootstrap(explicit, res, 8).explicit_axes == ("dp", "ep")
    assert mp.ep_bootstrap(auto, res, 8).explicit_axes == ()
    layout = mp.ep_bootstrap(mixed, res, 8)
    assert layout.explicit_axes == ("ep", )
    assert layout.explicit_spec(layout.token_spec) == P("ep")
    assert layout.explicit_spec(layout.weight_specs["wo"]) == P("ep", None, None)


def test_named_errors_on_explicit_meshes():
    """A role on a Manual axis, an indivisible token count and a mesh other than the one in
    scope each get their own error."""
    cfg = mp.MoEConfig(d_model=ep_util.D_MODEL, d_ff=ep_util.D_FF, num_experts=8)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jnp.ones((64, ep_util.D_MODEL))
    mesh, res = explicit_mesh("dp2xep4")

    def inside(x):  # moe_block inside the user's own shard_map over 'ep'
        inner = jax.sharding.get_abstract_mesh()
        return mp.moe_block(params, x, cfg, mesh=inner, resources=res).y

    with pytest.raises(ValueError,
                       match=r"mesh axes \['ep'\] of dp2 x ep4 \(axis types \('Explicit', "
                       r"'Manual'\)\) are Manual .* call moe_block outside that shard_map"):
        jax.jit(
            jax.shard_map(inside,
                          mesh=mesh,
                          in_specs=P("ep"),
                          out_specs=P("ep"),
                          axis_names={"ep"},
                          check_vma=False))(x)
    with pytest.raises(ValueError, match="60 tokens .* not divisible by the 8 token shards"):
        mp.moe_block(params, jnp.ones((60, ep_util.D_MODEL)), cfg, mesh=mesh, resources=res)
    auto, _ = explicit_mesh("dp2xep4", (AxisType.Auto, AxisType.Auto))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError,
                           match=r"the mesh dp2 x ep4 \(axis types \('Auto', 'Auto'\)\) differs "
                           r"from the mesh in scope dp2 x ep4 \(axis types \('Explicit', "
                           r"'Explicit'\)\).*mesh=jax.sharding.get_abstract_mesh\(\)"):
            mp.moe_block(params, x, cfg, mesh=auto, resources=res)


# ----------------------------------------------------------------------------- Praxis layer


@pytest.mark.parametrize("constrained", [False, True])
def test_praxis_layer_under_set_mesh_of_make_mesh_equals_single_device(constrained):
    """MoEFeedForward with mesh_resources under jax.set_mesh(jax.make_mesh(...)) (Explicit
    axes), with and without the layer's own activation sharding (gsm / gs, resharded on
    Explicit axes): outputs, aux losses and summaries equal one device."""
    kw = dict(gating_func="top2",
              use_gated_activation=True,
              router_z_loss_weight=0.1,
              unadjusted_expert_capacity_factor=1.5)
    x, pad = tpl_lib._inputs(19, pad_from=5)
    variables = tpl_lib._init_layer(tpl_lib._moe_tpl(**kw), x, pad, seed=20)
    ref = tpl_lib._run_layer(tpl_lib._moe_tpl(**kw), variables, x, pad)
    mesh = jax.make_mesh((2, 2), ("data", "expert"), devices=jax.devices()[:4])
    assert mesh.axis_types == (AxisType.Explicit, ) * 2
    tpl = tpl_lib._moe_tpl(**kw, mesh_resources=mp.MeshResources(dp="data", ep="expert"))
    if constrained:
        tpl.ici_mesh_shape = [2, 2]
        tpl.mesh_axis_names = ["data", "expert"]
        tpl.activation_split_dims_mapping.gsm = ["data", None, None]
        tpl.activation_split_dims_mapping.gs = ["data", None]
    with jax.set_mesh(mesh):
        got = tpl_lib._run_layer(tpl, variables, x, pad)
    assert tpl_lib._rel(got[0], ref[0]) < 1e-5
    for name in ("aux_moe_load_balance_loss", "aux_moe_z_loss"):
        np.testing.assert_allclose(got[2][name].value, ref[2][name].value, rtol=1e-5)
    for name, value in ref[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert float(ref[1]["moe_dropped_token_fraction_scalar"]) > 0
