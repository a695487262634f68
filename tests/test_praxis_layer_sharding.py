"""MoEFeedForward under meshes: declared activation constraints, expert parallelism and the
weights' layout sharding against one device (float32, 1e-5 relative), and the named errors of
bad layouts (DP2 x FSDP2 x EP2 on the 8 CPU devices)."""

import re

import jax
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import MoEFeedForward

from praxis import base_layer, pax_fiddle, py_utils
from praxis.layers import transformer_models

from tests.praxis_layer_util import (_EP_AXES, _ctx, _ep_tpl, _init_layer, _inputs, _lm_apply,
                                     _lm_batch, _lm_init, _lm_tpl, _mesh_2x2, _moe_tpl, _rel,
                                     _run_layer, _weight_specs)

# ----------------------------------------------------------------------------- sharding


def test_declared_activation_constraints_in_hlo():
    tpl = _moe_tpl(gating_func="dense_top2", ici_mesh_shape=[2, 2], mesh_axis_names=["data", "mdl"])
    tpl.activation_split_dims_mapping.gsm = ["data", None, "mdl"]
    tpl.activation_split_dims_mapping.gs = ["data", None]
    tpl.weight_split_dims_mapping.me = [None, "mdl"]
    tpl.weight_split_dims_mapping.emh = ["data", None, "mdl"]
    tpl.weight_split_dims_mapping.ehm = ["data", "mdl", None]
    x, pad = _inputs(17)
    variables = _init_layer(tpl, x, pad)
    layer = base_layer.instantiate(tpl)
    with _ctx():
        specs = base_layer.var_partition_specs(layer.abstract_init_with_metadata(x, pad),
                                               mesh_shape=[2, 2],
                                               device_axis_names=["data", "mdl"])["params"]
    P = jax.sharding.PartitionSpec
    assert (specs["router"], specs["wi_up"], specs["wo"]) == (P(None,
                                                                "mdl"), P("data", None, "mdl"),
                                                              P("data", "mdl", None))

    def lowered(tpl_):
        layer_ = base_layer.instantiate(tpl_)

        def f(v, x, pad):
            with _ctx():
                return layer_.apply(v, x, pad)

        with jax.set_mesh(_mesh_2x2()):
            return jax.jit(f).lower(variables, x, pad).as_text()

    text = lowered(tpl)
    bsm = re.findall(
        r'sharding_constraint .*<@mesh, \[\{"data"\}, \{\}, \{"mdl"\}\]>.*'
        r'tensor<4x8x16xf32>', text)
    bs = re.findall(r'sharding_constraint .*<@mesh, \[\{"data"\}, \{\}\]>.*tensor<4x8xf32>', text)
    assert len(bsm) == 2 and len(bs) == 1, text  # moe_block input and output; paddings
    plain = tpl.clone()
    plain.activation_split_dims_mapping.gsm = None
    plain.activation_split_dims_mapping.gs = None
    assert "sharding_constraint" not in lowered(plain)


@pytest.mark.parametrize("gating_func", ["dense_top2", "top2"])
def test_expert_parallel_matches_single_device(gating_func, monkeypatch):
    """mesh_resources under jax.set_mesh (DP2 x EP2 on 4 CPU devices) = one device."""
    from moe_praxis import MeshResources, moe

    calls = []
    sharded = moe.sharded_fn
    monkeypatch.setattr(moe, "sharded_fn", lambda *a, **k: calls.append(1) or sharded(*a, **k))

    kw = dict(gating_func=gating_func, use_gated_activation=True, router_z_loss_weight=0.1)
    if gating_func == "top2":
        kw.update(unadjusted_expert_capacity_factor=1.5)  # C = round4(int(32*1.5/4)) = 12
    x, pad = _inputs(19, pad_from=5)
    variables = _init_layer(_moe_tpl(**kw), x, pad, seed=20)
    ref = _run_layer(_moe_tpl(**kw), variables, x, pad)
    mesh = jax.make_mesh((2, 2), ("data", "expert"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 2)
    tpl = _moe_tpl(**kw, mesh_resources=MeshResources(dp="data", ep="expert"))
    with jax.set_mesh(mesh):
        got = _run_layer(tpl, variables, x, pad)
    assert calls  # the expert-parallel path ran
    assert _rel(got[0], ref[0]) < 1e-5
    for name in ("aux_moe_load_balance_loss", "aux_moe_z_loss"):
        np.testing.assert_allclose(got[2][name].value, ref[2][name].value, rtol=1e-5)
    for name, value in ref[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    if gating_func == "top2":
        assert float(ref[1]["moe_dropped_token_fraction_scalar"]) > 0


def test_set_sharding_params_v1_configures_the_layer():
    lm_p = _lm_tpl(pax_fiddle.Config(MoEFeedForward))
    lm_p = transformer_models.TransformerLm.set_sharding_params_v1(
        lm_p,
        replica_axis="replica",
        data_axis="data",
        mdl_axis="mdl",
        ici_mesh_shape=[1, 2, 2],
        mesh_axis_names=["replica", "data", "mdl"],
        training_optimized=True)
    moe_p = lm_p.stacked_transformer_tpl.moe_layer_tpl
    assert moe_p.weight_split_dims_mapping.emh == ["data", None, "mdl"]
    assert moe_p.weight_split_dims_mapping.ehm == ["data", "mdl", None]
    assert moe_p.activation_split_dims_mapping.gsm == ["data", None, "mdl"]
    lm = base_layer.instantiate(lm_p)
    inp, tgt, pad = _lm_batch(jax.random.PRNGKey(0))
    labels = py_utils.NestedMap(class_ids=tgt, class_weights=1.0 - pad)
    with _ctx():
        specs = base_layer.var_partition_specs(lm.abstract_init_with_metadata(inp,
                                                                              pad,
                                                                              labels=labels),
                                               mesh_shape=[1, 2, 2],
                                               device_axis_names=["replica", "data",
                                                                  "mdl"])["params"]
    ff = specs["transformer"]["x_layers_1"]["ff_layer"]
    P = jax.sharding.PartitionSpec
    assert ff["wi_up"] == P("data", None, "mdl") and ff["wo"] == P("data", "mdl", None)
    mesh = jax.make_mesh((1, 2, 2), ("replica", "data", "mdl"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 3)
    params = _lm_init(lm)

    def f(p):
        return _lm_apply(lm, p, inp, tgt, pad)[0].total_loss

    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(params).as_text()
    assert re.search(r'<@mesh, \[\{"data"\}, \{\}, \{"mdl"\}\]>.*tensor<4x8x16xf32>', text)


def test_weight_sharding_defaults_to_and_is_checked_against_the_layout():
    """With mesh_resources and the layer's mesh: unset me / emh / ehm take
    EPLayout.weight_specs; the layout's own values are accepted; anything else raises,
    naming the field, the value given and the value the layout needs."""
    from moe_praxis import MeshResources, ep_bootstrap

    mesh = jax.sharding.AbstractMesh((2, 2, 2), _EP_AXES)
    layout = ep_bootstrap(mesh, MeshResources(dp="data", fsdp="fsdp", ep="expert"), 8)
    want = layout.weight_specs
    assert want["wi_up"] == jax.sharding.PartitionSpec(("expert", "fsdp"), None, None)
    for tpl in (_ep_tpl(),
                _ep_tpl(emh=[("expert", "fsdp"), None, None],
                        ehm=(("expert", "fsdp"), None, None),
                        me=[None, None])):
        specs = _weight_specs(tpl)
        assert (specs["router"], specs["wi_up"], specs["wo"]) == (want["router"], want["wi_up"],
                                                                  want["wo"])
    gated = _weight_specs(_ep_tpl(use_gated_activation=True, fuse_gate_up=True))
    assert gated["wi_gate_up"] == want["wi_gate_up"]
    bad = [
        ("emh", ["expert", None, None], r"weight_split_dims_mapping.emh=\['expert', None, None\] "
         r"does not match .* needs \[\('expert', 'fsdp'\), None, None\]"),
        ("ehm", [("expert", "fsdp"), None, "fsdp"], r"weight_split_dims_mapping.ehm=.* needs "
         r"\[\('expert', 'fsdp'\), None, None\] \(EPLayout.weight_specs\['wo'\]\)"),
        ("me", [None, "expert"], r"weight_split_dims_mapping.me=\[None, 'expert'\] .*needs "
         r"\[None, None\]"),
    ]
    x, pad = _inputs(0)
    for letter, value, match in bad:
        with pytest.raises(ValueError, match=r"MoEFeedForward 'moe': " + match):
            _init_layer(_ep_tpl(**{letter: value}), x, pad)
    # The layout itself is validated by ep_bootstrap, its error named with the layer.
    with pytest.raises(ValueError,
                       match=r"MoEFeedForward 'moe': mesh_resources=.*num_experts=5 "
                       r"is not divisible by the ep size 2"):
        _init_layer(_ep_tpl(num_experts=5), x, pad)


def test_fsdp_first_expert_sharding_gets_the_named_error():
    """emh (('fsdp', 'ep'), None, None) on EP2 x FSDP2 would give EP rank 0 experts
    [0, 1, 4, 5]: resources.py's fsdp-before-ep error, naming the field. With fsdp of size 1
    the same order gathers the same experts and is accepted."""
    x, pad = _inputs(0)
    for letter in ("emh", "ehm"):
        with pytest.raises(ValueError,
                           match=rf"weight_split_dims_mapping.{letter}=.*puts fsdp before ep on "
                           r"the expert dimension.*EP rank 0 would gather experts \[0, 1, 4, 5\]"):
            _init_layer(_ep_tpl(**{letter: [("fsdp", "expert"), None, None]}), x, pad)
    specs = _weight_specs(_ep_tpl(emh=[("fsdp", "expert"), None, None], shape=(2, 1, 4)))
    assert specs["wi_up"] == jax.sharding.PartitionSpec(("fsdp", "expert"), None, None)


def test_layout_sharded_weights_match_single_device():
    """Weights placed by the layer's (layout-derived) specs on DP2 x FSDP2 x EP2, run under
    jax.set_mesh: the same outputs, losses and summaries as one device."""
    kw = dict(use_gated_activation=True, router_z_loss_weight=0.1)
    x, pad = _inputs(23, pad_from=5)
    tpl = _ep_tpl(**kw)
    variables = _init_layer(_moe_tpl(num_experts=8, gating_func="dense_top2", **kw),
                            x,
                            pad,
                            seed=24)
    ref = _run_layer(_moe_tpl(num_experts=8, gating_func="dense_top2", **kw), variables, x, pad)
    mesh = jax.make_mesh((2, 2, 2), _EP_AXES, axis_types=(jax.sharding.AxisType.Auto, ) * 3)
    specs = _weight_specs(tpl)
    params = {
        k:
        jax.device_put(v, jax.sharding.NamedSharding(mesh, specs[k]))
        if k in specs and not isinstance(v, dict) else v
        for k, v in variables["params"].items()
    }
    with jax.set_mesh(mesh):
        got = _run_layer(tpl, {"params": params}, x, pad)
    assert params["wi_up"].sharding.spec == jax.sharding.PartitionSpec(("expert", "fsdp"), None,
                                                                       None)
    assert _rel(got[0], ref[0]) < 1e-5
    for name, value in ref[2].items():
        np.testing.assert_allclose(got[2][name].value, value.value, rtol=1e-5, err_msg=name)
    for name, value in ref[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
