"""MeshResources and ep_bootstrap: the numbers, the specs and every refusal."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from moe_praxis import resources as res_lib


def mesh_of(shape, names):
    devices = np.array(jax.devices("cpu")[:math.prod(shape)]).reshape(shape)
    return Mesh(devices, names)


# (mesh shape, names, MeshResources kwargs, E) ->
#     (ep_size, num_ep_groups, experts_per_rank, num_token_shards, token_axes)
BOOTSTRAP = [
    ((8, ), ("dp", ), dict(dp="dp"), 8, (1, 8, 8, 8, ("dp", ))),
    ((8, ), ("fsdp", ), dict(fsdp="fsdp"), 8, (1, 8, 8, 8, ("fsdp", ))),
    ((8, ), ("ep", ), dict(ep="ep"), 8, (8, 1, 1, 8, ("ep", ))),
    ((8, ), ("ep", ), dict(ep="ep"), 16, (8, 1, 2, 8, ("ep", ))),
    ((2, 4), ("dp", "ep"), dict(dp="dp", ep="ep"), 8, (4, 2, 2, 8, ("dp", "ep"))),
    ((2, 4), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep"), 8, (4, 2, 2, 8, ("fsdp", "ep"))),
    # DP2 x FSDP2 x EP2: dp AND fsdp make the groups: 4 groups of 2 (never 2 groups)
    ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp",
                                           ep="ep"), 8, (2, 4, 4, 8, ("dp", "fsdp", "ep"))),
    ((4, 2), ("dp", "ep"), dict(dp="dp", ep="ep"), 8, (2, 4, 4, 8, ("dp", "ep"))),
    ((4, 2), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep"), 16, (2, 4, 8, 8, ("fsdp", "ep"))),
    ((2, 2, 2), ("ep", "tp", "dp"), dict(ep="ep", tp="tp", dp="dp"), 8, (2, 2, 4, 4, ("dp", "ep"))),
    ((2, 2, 2), ("dp", "ea", "eb"), dict(dp="dp",
                                         ep=("ea", "eb")), 8, (4, 2, 2, 8, ("dp", "ea", "eb"))),
    ((2, 2, 2), ("d1", "d2", "ep"), dict(dp=("d1", "d2"),
                                         ep="ep"), 8, (2, 4, 4, 8, ("d1", "d2", "ep"))),
]


@pytest.mark.parametrize("shape,names,kw,e,want", BOOTSTRAP)
def test_bootstrap_numbers(shape, names, kw, e, want):
    layout = mp.ep_bootstrap(mesh_of(shape, names), mp.MeshResources(**kw), e)
    got = (layout.ep_size, layout.num_ep_groups, layout.experts_per_rank, layout.num_token_shards,
           layout.token_axes)
    assert got == want
    # every device belongs to exactly one EP group of ep_size ranks (tp replicates tokens)
    assert layout.num_ep_groups * layout.ep_size * layout.tp_size == math.prod(shape)


def test_dp2_fsdp2_ep2_specs():
    mesh = mesh_of((2, 2, 2), ("dp", "fsdp", "ep"))
    layout = mp.ep_bootstrap(mesh, mp.MeshResources(dp="dp", fsdp="fsdp", ep="ep"), 8)
    assert layout.num_ep_groups == 4 and layout.ep_size == 2
    assert layout.token_spec == P(("dp", "fsdp", "ep"))
    assert layout.expert_spec == P(("ep", "fsdp"))  # ep BEFORE fsdp
    specs = layout.weight_specs
    assert specs["wi_up"] == P(("ep", "fsdp"), None, None)
    assert specs["wo"] == P(("ep", "fsdp"), None, None)
    assert specs["router"] == P(None, None)
    assert [layout.experts_of_rank(r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fsdp_on_model_and_tp_specs():
    mesh = mesh_of((2, 2, 2), ("fsdp", "ep", "tp"))
    layout = mp.ep_bootstrap(mesh, mp.MeshResources(fsdp="fsdp", ep="ep", tp="tp",
                                                    fsdp_dim="model"), 8)
    assert layout.expert_spec == P("ep")
    assert layout.weight_specs["wi_gate"] == P("ep", "fsdp", "tp")
    assert layout.weight_specs["wo"] == P("ep", "tp", "fsdp")


def test_gathered_experts_of_the_ep_first_layout_are_contiguous():
    mesh = mesh_of((2, 2), ("ep", "fsdp"))
    for r, want in enumerate([[0, 1, 2, 3], [4, 5, 6, 7]]):
        assert res_lib.gathered_experts(mesh, ("ep", "fsdp"), ("ep", ), ("fsdp", ), 8, r) == want
    # and the fsdp-first one is not (the bug this module exists to prevent)
    assert res_lib.gathered_experts(mesh, ("fsdp", "ep"), ("ep", ), ("fsdp", ), 8,
                                    0) == [0, 1, 4, 5]


def test_fsdp_first_expert_layout_is_refused():
    mesh = mesh_of((2, 2), ("ep", "fsdp"))
    bad = mp.MeshResources(fsdp="fsdp", ep="ep", expert_dim_order=("fsdp", "ep"))
    with pytest.raises(ValueError) as err:
        mp.ep_bootstrap(mesh, bad, 8)
    msg = str(err.value)
    assert "EP rank 0 would gather experts [0, 1, 4, 5]" in msg
    assert "[0, 1, 2, 3]" in msg and "('ep', 'fsdp')" in msg and "fsdp_dim='model'" in msg
    # the same layout through moe_block is refused too
    cfg = mp.MoEConfig(d_model=8, d_ff=8, num_experts=8)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match=r"\[0, 1, 4, 5\]"):
        mp.moe_block(params, np.ones((8, 8), np.float32), cfg, mesh=mesh, resources=bad)
    # the ep-first order is accepted, and so is any order when one of the sizes is 1
    mp.ep_bootstrap(mesh, mp.MeshResources(fsdp="fsdp", ep="ep", expert_dim_order=("ep", "fsdp")),
                    8)
    mesh41 = mesh_of((4, 1), ("ep", "fsdp"))
    mp.ep_bootstrap(mesh41, mp.MeshResources(fsdp="fsdp", ep="ep", expert_dim_order=("fsdp", "ep")),
                    8)


@pytest.mark.parametrize("kw,e,kwargs,match", [
    (dict(ep="expert"), 8, {}, "names mesh axis 'expert', which the mesh does not have"),
    (dict(dp="dp", ep="ep", tp="tp"), 7, {}, "num_experts=7 is not divisible by the ep size 2"),
    (dict(fsdp="dp", ep="ep"), 2, {}, "not divisible by ep x fsdp = 2 x 2"),
    (dict(dp="dp", ep="ep", tp="tp"), 8, dict(d_ff=5), "d_ff=5 is not divisible by the tp"),
    (dict(fsdp="dp", ep="ep", fsdp_dim="model"), 8, dict(d_model=3), "d_model=3"),
    (dict(fsdp="dp", ep="ep", expert_dim_order=("ep", )), 8, {}, "must name exactly"),
])
def test_bootstrap_errors(kw, e, kwargs, match):
    mesh = mesh_of((2, 2, 2), ("dp", "ep", "tp"))
    with pytest.raises(ValueError, match=match):
        mp.ep_bootstrap(mesh, mp.MeshResources(**kw), e, **kwargs)


def test_mesh_resources_validation():
    with pytest.raises(ValueError,
                       match="'x' is given two roles, MeshResources.dp and "
                       "MeshResources.ep"):
        mp.MeshResources(dp="x", ep=("y", "x"))
    with pytest.raises(ValueError, match="fsdp_dim='hidden' is invalid"):
        mp.MeshResources(fsdp_dim="hidden")
    with pytest.raises(ValueError, match="MeshResources.tp=3 is invalid"):
        mp.MeshResources(tp=3)
    with pytest.raises(ValueError, match="names an axis twice"):
        mp.MeshResources(ep=("a", "a"))
    with pytest.raises(ValueError, match="must be a moe_praxis.MeshResources"):
        mp.ep_bootstrap(mesh_of((2, ), ("ep", )), {"ep": "ep"}, 8)
    r = mp.MeshResources(dp=("a", "b"), ep="c")
    assert r.axes("dp") == ("a", "b") and r.axes("ep") == ("c", ) and r.axes("tp") == ()


def test_mesh_resources_roles_without_a_mesh():
    r = mp.MeshResources(dp=("d1", "d2"), fsdp="f", ep="e", tp="t")
    assert r.token_axes == ("d1", "d2", "f", "e")
    assert mp.MeshResources(tp="t").token_axes == ()
    assert r.spec_entry("dp") == ("d1", "d2")
    assert r.spec_entry("fsdp") == "f"
    assert mp.MeshResources().spec_entry("ep") is None
    with pytest.raises(ValueError, match="role='batch' is invalid"):
        r.spec_entry("batch")
    r.check_axis_names(("d1", "d2", "f", "e", "t", "spare"))
    with pytest.raises(ValueError,
                       match=r"MeshResources.tp='t' is invalid: axis 't' is not a mesh axis; "
                       r"axes are \('d1', 'd2', 'f', 'e'\)"):
        r.check_axis_names(["d1", "d2", "f", "e"])
    with pytest.raises(ValueError, match="names an axis twice"):
        r.check_axis_names(("d1", "d2", "f", "e", "t", "t"))
    with pytest.raises(ValueError, match="axis 'x' already plays 'dp'"):
        mp.MeshResources(dp="x", fsdp="x")


def test_bootstrap_without_a_mesh_is_one_device():
    layout = mp.ep_bootstrap(None, None, 8, d_model=6, d_ff=5)
    assert (layout.dp_size, layout.fsdp_size, layout.ep_size, layout.tp_size) == (1, 1, 1, 1)
    assert layout.token_axes == () and layout.num_token_shards == 1
    assert layout.experts_per_rank == 8 and layout.experts_of_rank(0) == list(range(8))
    assert layout.weight_specs["wi_up"] == P(None, None, None)
    assert mp.ep_bootstrap(None, mp.MeshResources(), 8) == layout
    with pytest.raises(ValueError, match="name mesh axes but mesh is None"):
        mp.ep_bootstrap(None, mp.MeshResources(ep="ep"), 8)


def test_bootstrap_is_evaluated_once_for_identical_calls(monkeypatch):
    """Experiments and the Praxis layer validate at build time and moe_block asks again per
    layer and trace: identical calls must validate once and share one EPLayout."""
    calls = []
    real = res_lib._bootstrap
    monkeypatch.setattr(res_lib, "_bootstrap", lambda *a: calls.append(a) or real(*a))
    res_lib._bootstrap_memo.cache_clear()
    mesh = mesh_of((2, 4), ("dp", "ep"))
    abstract = jax.sharding.AbstractMesh((2, 4), ("dp", "ep"))
    res = mp.MeshResources(dp="dp", ep="ep")
    first = mp.ep_bootstrap(mesh, res, 8, d_model=16, d_ff=32)
    for _ in range(3):
        assert mp.ep_bootstrap(mesh, mp.MeshResources(dp="dp", ep="ep"), 8, d_model=16,
                               d_ff=32) is first
    assert len(calls) == 1
    mp.ep_bootstrap(abstract, res, 8, d_model=16, d_ff=32)  # another mesh: evaluated again
    mp.ep_bootstrap(abstract, res, 8, d_model=16, d_ff=32)
    assert len(calls) == 2
    mp.ep_bootstrap(mesh, res, 16, d_model=16, d_ff=32)  # other arguments: evaluated again
    assert len(calls) == 3
    # a refused layout is refused every time (errors are not remembered as layouts)
    for _ in range(2):
        with pytest.raises(ValueError, match="num_experts=6 is not divisible by the ep size 4"):
            mp.ep_bootstrap(mesh, res, 6)
    assert len(calls) == 5
    # and the trace of moe_block asks the memoised bootstrap, not a second validation
    cfg = mp.MoEConfig(d_model=16, d_ff=32, num_experts=8, top_k=2)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    jax.eval_shape(lambda p, x: mp.moe_block(p, x, cfg, mesh=mesh, resources=res), params,
                   jax.ShapeDtypeStruct((64, 16), jnp.float32))
    assert len(calls) == 5


DOCS = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "parallelism.md"


def _doc_table(marker):
    text = DOCS.read_text()
    body = text.split(f"<!-- BEGIN {marker} -->")[1].split(f"<!-- END {marker} -->")[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_list_every_mesh_resources_field_with_its_default():
    import dataclasses

    rows = _doc_table("MESHRESOURCES TABLE")
    fields = {f.name: f.default for f in dataclasses.fields(mp.MeshResources)}
    assert set(rows) == set(fields)
    for name, default in fields.items():
        assert rows[name][0] == f"`{default!r}`", name
    assert all(f"`'{d}'`" in rows["fsdp_dim"][1] for d in res_lib.FSDP_DIMS)


def test_docs_list_the_ep_config_fields_defaults_and_values():
    import dataclasses

    from moe_praxis import config as config_lib

    rows = _doc_table("EP CONFIG TABLE")
    defaults = {f.name: f.default for f in dataclasses.fields(mp.MoEConfig)}
    assert set(rows) == {"ep_exchange", "ep_buffer_factor"}
    for name, (default, _) in rows.items():
        assert default == f"`{defaults[name]!r}`", name
    documented = [v.strip().strip("`").strip("'") for v in rows["ep_exchange"][1].split(",")]
    assert documented == list(config_lib.EP_EXCHANGES)
