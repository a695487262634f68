"""MoEFeedForward's routing options, shared experts and the trained expert bias.

Each layer option is one MoEConfig field (moe_praxis.praxis.fields.CONFIG_FIELDS); the layer
with an option must compute exactly moe_block with the layer's MoEConfig on the layer-normed
input. Tolerance: float32 layer against float32 moe_block, 1e-6 relative (the same ops in the
same order; only XLA's fusion may differ).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import moe_block
from moe_praxis.praxis import fields
from moe_praxis.praxis.gshard import capacity_and_groups
from praxis import base_layer
from tests.praxis_layer_util import E, _ctx, _init_layer, _inputs, _jit, _moe_tpl, _rel

NT = base_layer.NON_TRAINABLE


def _variables(tpl, x, pad, seed):
    """Initialised variables; a random expert bias (when the layer has one) so it steers."""
    v = _init_layer(tpl, x, pad, seed=seed)
    if NT in v and "expert_bias" in v[NT]:
        bias = 0.2 * jax.random.normal(jax.random.PRNGKey(seed + 1), (E, ), jnp.float32)
        v = dict(v, **{NT: dict(v[NT], expert_bias=bias)})
    return v


def _layer_and_block(tpl, variables, x, pad, do_eval=False):
    """(layer output, the layer's MoEConfig, moe_block's output on the layer-normed x, the
    updated collections)."""
    layer = base_layer.instantiate(tpl)

    def f(v, x, pad):
        ctx = base_layer.JaxContext.HParams(do_eval=do_eval)
        with base_layer.JaxContext.new_context(hparams=ctx):
            y, upd = layer.apply(v, x, pad, mutable=[NT, base_layer.SUMMARIES])
            xn = layer.apply(v, x, method=lambda m, x: m.layer_norm(x))
        return y, xn, upd

    y, xn, upd = _jit(f, variables, x, pad)(variables, x, pad)
    with _ctx():
        config = layer.apply(variables, method=lambda m: m.moe_config)
    if tpl.gating_func == "top2":  # the capacity the layer swaps in per call (one group)
        cf, _ = capacity_and_groups(int(np.prod(pad.shape)),
                                    num_experts=config.num_experts,
                                    top_k=2,
                                    num_groups=1,
                                    min_group_size=None,
                                    expert_capacity_dim=tpl.expert_capacity_dim,
                                    capacity_factor=tpl.unadjusted_expert_capacity_factor,
                                    where="test")
        config = dataclasses.replace(config, capacity_factor=cf)
    params = dict(variables["params"])
    params.pop("layer_norm")
    if NT in variables:
        params.update(variables[NT])
    out = moe_block(params, xn, config, paddings=pad)
    return y, config, out, upd


OPTIONS = [
    dict(score_func="sigmoid"),
    dict(score_func="sigmoid",
         num_expert_groups=2,
         group_topk=1,
         use_expert_bias=True,
         routed_scaling_factor=2.5),
    dict(pre_softmax=False, norm_topk=False, num_experts_per_token=3),
    dict(use_expert_bias=True, norm_topk=False),
    dict(capacity_factor=0.5),
    dict(capacity_factor=0.75, drop_policy="weight", router_z_loss_weight=0.1),
    dict(num_shared_experts=1),
    dict(num_shared_experts=2, shared_hidden_dims=8, shared_expert_gate=True, score_func="sigmoid"),
    dict(gating_func="dense_top2", num_shared_experts=1, shared_expert_gate=True),
    dict(gating_func="top2", num_shared_experts=1, unadjusted_expert_capacity_factor=1.0),
]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: "-".join(sorted(kw)))
def test_layer_option_equals_moe_block(kw):
    """MoEFeedForward(gating_func='topk', option) = x + moe_block(layer_norm(x)) with the
    layer's MoEConfig, and each option reached that MoEConfig under the same name."""
    kw = dict(kw)
    gating_func = kw.pop("gating_func", "topk")
    tpl = _moe_tpl(gating_func=gating_func, use_gated_activation=True, **kw)
    x, pad = _inputs(31, pad_from=5)
    variables = _variables(tpl, x, pad, seed=32)
    y, config, out, _ = _layer_and_block(tpl, variables, x, pad)
    to_config = {v: k for k, v in fields.CONFIG_FIELDS.items()}
    for field, value in kw.items():
        if field in to_config:
            assert getattr(config, to_config[field]) == value, field
    assert _rel(y, x + out.y) < 1e-6
    if "capacity_factor" in kw or gating_func == "top2":
        assert int(out.dropped_tokens) > 0  # the capacity binds


@pytest.mark.parametrize("gating_func", ["top2", "dense_top2"])
@pytest.mark.parametrize("field,value", [(f, v) for f, v in [
    ("score_func", "sigmoid"),
    ("pre_softmax", False),
    ("norm_topk", False),
    ("num_expert_groups", 2),
    ("use_expert_bias", True),
    ("routed_scaling_factor", 2.5),
    ("capacity_factor", 1.0),
    ("drop_policy", "weight"),
]])
def test_option_gshard_gating_cannot_honour_is_a_named_error(gating_func, field, value):
    x, pad = _inputs(0)
    with pytest.raises(ValueError,
                       match=rf"MoEFeedForward 'moe': {field}={value!r} is not supported: "
                       rf"gating_func='{gating_func}' is GShard's softmax top-2"):
        _init_layer(_moe_tpl(gating_func=gating_func, **{field: value}), x, pad)


def test_invalid_option_value_is_moe_config_error_naming_the_field():
    x, pad = _inputs(0)
    with pytest.raises(ValueError,
                       match=r"MoEFeedForward 'moe': MoEConfig.score_func='relu' is invalid.*"
                       r"\(the layer's score_func='relu'\)"):
        _init_layer(_moe_tpl(gating_func="topk", score_func="relu"), x, pad)


def test_expert_bias_is_a_float32_non_trainable_variable():
    x, pad = _inputs(0)
    v = _init_layer(_moe_tpl(gating_func="topk", use_expert_bias=True), x.astype(jnp.bfloat16), pad)
    assert "expert_bias" not in v["params"]
    assert v[NT]["expert_bias"].dtype == jnp.float32
    np.testing.assert_array_equal(v[NT]["expert_bias"], np.zeros(E))


def test_shared_expert_variables_and_their_sharding_letters():
    """shared_wi_gate / shared_wi_up [M, Hs] (letter mh), shared_wo [Hs, M] (hm), shared_gate
    [M, 1] replicated; with mesh_resources and the layer's mesh, unset mh / hm take the
    layout's specs and a set one that differs is an error naming the field and the need."""
    from tests.praxis_layer_util import _ep_tpl, _weight_specs
    from moe_praxis import MeshResources, ep_bootstrap

    kw = dict(num_shared_experts=2, shared_expert_gate=True, use_gated_activation=True)
    x, pad = _inputs(0)
    v = _init_layer(_moe_tpl(**kw), x, pad)["params"]
    hs = 2 * 24
    assert {
        k: v[k].shape
        for k in v if k.startswith("shared")
    } == {
        "shared_wi_gate": (16, hs),
        "shared_wi_up": (16, hs),
        "shared_wo": (hs, 16),
        "shared_gate": (16, 1)
    }
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "expert"))
    want = ep_bootstrap(mesh, MeshResources(dp="data", fsdp="fsdp", ep="expert"), 8,
                        shared_d_ff=hs).weight_specs
    specs = _weight_specs(_ep_tpl(**kw))
    for name in ("shared_wi_gate", "shared_wi_up", "shared_wo", "shared_gate"):
        assert specs[name] == want[name], name
    assert specs["shared_wi_up"] == jax.sharding.PartitionSpec("fsdp", None)
    tpl = _ep_tpl(**kw)
    tpl.weight_split_dims_mapping.hm = [None, "expert"]
    with pytest.raises(ValueError,
                       match=r"MoEFeedForward 'moe': weight_split_dims_mapping.hm=\[None, "
                       r"'expert'\] does not match .* needs \[None, 'fsdp'\] "
                       r"\(EPLayout.weight_specs\['shared_wo'\]\)"):
        _init_layer(tpl, x, pad)
    tpl = _moe_tpl(**kw)
    tpl.weight_split_dims_mapping.mh = ["data"]
    with pytest.raises(ValueError, match=r"weight_split_dims_mapping.mh.*2 entries"):
        _init_layer(tpl, x, pad)


def _rule(bias, counts, rate):
    """float64 numpy of DeepSeek-V3's rule: b + u * sign(mean(load) - load), sign(0) = 0."""
    c = np.asarray(counts, np.float64)
    return np.asarray(bias, np.float64) + rate * np.sign(c.mean() - c)


def test_bias_update_in_the_layer_is_update_expert_bias_on_the_calls_counts():
    """A training call with NON_TRAINABLE mutable writes update_expert_bias(bias, counts, u)
    of that call's global tokens_per_expert (float32); an eval call, a call without
    NON_TRAINABLE mutable and a layer with rate 0 leave it as it was."""
    rate = 0.125
    tpl = _moe_tpl(gating_func="topk",
                   score_func="sigmoid",
                   use_expert_bias=True,
                   expert_bias_update_rate=rate,
                   num_shared_experts=1)
    x, pad = _inputs(41, pad_from=3)
    variables = _variables(tpl, x, pad, seed=42)
    bias = variables[NT]["expert_bias"]
    y, _, out, upd = _layer_and_block(tpl, variables, x, pad)
    assert _rel(y, x + out.y) < 1e-6  # the update changes nothing of this call's output
    new = upd[NT]["expert_bias"]
    assert new.dtype == jnp.float32
    counts = out.tokens_per_expert
    np.testing.assert_array_equal(new, moe_praxis.update_expert_bias(bias, counts, rate))
    np.testing.assert_allclose(new, _rule(bias, counts, rate), rtol=0, atol=1e-7)
    assert float(jnp.max(jnp.abs(new - bias))) == rate  # the counts are not all equal
    _, _, _, upd = _layer_and_block(tpl, variables, x, pad, do_eval=True)
    np.testing.assert_array_equal(upd[NT]["expert_bias"], bias)
    still = tpl.clone()
    still.expert_bias_update_rate = 0.0
    _, _, _, upd = _layer_and_block(still, variables, x, pad)
    np.testing.assert_array_equal(upd[NT]["expert_bias"], bias)
    with pytest.raises(ValueError,
                       match=r"expert_bias_update_rate=0.1 is not supported: "
                       r"gating_func='dense_top2'"):
        _init_layer(_moe_tpl(gating_func="dense_top2", expert_bias_update_rate=0.1), x, pad)
    with pytest.raises(ValueError,
                       match=r"MoEConfig.expert_bias_update_rate=0.1 .*use_expert_"
                       r"bias.*\(the layer's expert_bias_update_rate=0.1\)"):
        _init_layer(_moe_tpl(gating_func="topk", expert_bias_update_rate=0.1), x, pad)


def test_expert_parallel_layer_with_every_option_matches_single_device():
    """DP2 x EP2 (mesh_resources under jax.set_mesh, 4 CPU devices): sigmoid group-limited
    routing, the expert bias and its update, routed scaling and a gated shared expert give
    one device's output, summaries and updated bias (the update reads the global counts)."""
    from moe_praxis import MeshResources

    kw = dict(gating_func="topk",
              score_func="sigmoid",
              num_expert_groups=2,
              group_topk=1,
              use_expert_bias=True,
              expert_bias_update_rate=0.01,
              routed_scaling_factor=2.5,
              num_shared_experts=1,
              shared_expert_gate=True,
              use_gated_activation=True)
    tpl = _moe_tpl(**kw)
    x, pad = _inputs(51, pad_from=5)
    variables = _variables(tpl, x, pad, seed=52)
    layer = base_layer.instantiate(tpl)
    ep = base_layer.instantiate(_moe_tpl(**kw, mesh_resources=MeshResources(dp="data",
                                                                            ep="expert")))

    def f(lyr):

        def g(v, x, pad):
            with _ctx():
                return lyr.apply(v, x, pad, mutable=[NT, base_layer.SUMMARIES])

        return g

    ref_y, ref = _jit(f(layer), variables, x, pad)(variables, x, pad)
    mesh = jax.make_mesh((2, 2), ("data", "expert"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 2)
    with jax.set_mesh(mesh):
        got_y, got = _jit(f(ep), variables, x, pad)(variables, x, pad)
    assert _rel(got_y, ref_y) < 1e-5
    np.testing.assert_array_equal(got[NT]["expert_bias"], ref[NT]["expert_bias"])
    assert np.any(np.asarray(ref[NT]["expert_bias"]) != np.asarray(variables[NT]["expert_bias"]))
    for name, value in ref[base_layer.SUMMARIES].items():
        np.testing.assert_allclose(got[base_layer.SUMMARIES][name],
                                   value,
                                   rtol=1e-5,
                                   atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("gating_func", ["topk", "top2"])
def test_fp8_field_reaches_moe_block_and_changes_the_output(gating_func):
    """MoEFeedForward(fp8='blockwise') = x + moe_block(layer_norm(x)) with config.fp8 set (1e-6,
    as the other options), and that output differs from the layer without fp8 by the FP8
    rounding (above 1e-3 relative, below 0.1: e4m3's 2^-4 relative step on both operands of
    three GEMMs), so the field is not silently dropped; the summaries say which GEMMs ran FP8:
    with fp8_gemms='all' every one; with 'auto' at these few rows per expert none (the layer's
    output is then the bf16 layer's, bitwise: the weights' FP8 form would not pay)."""
    m = h = 128  # whole 128 x 128 weight blocks
    x = jax.random.normal(jax.random.PRNGKey(41), (2, 16, m), jnp.float32)
    pad = jnp.zeros((2, 16), jnp.float32)
    kw = dict(gating_func=gating_func, input_dims=m, hidden_dims=h, use_gated_activation=True)
    tpl = _moe_tpl(fp8="blockwise", fp8_gemms="all", **kw)
    variables = _init_layer(tpl, x, pad, seed=42)
    y, config, out, upd = _layer_and_block(tpl, variables, x, pad)
    assert config.fp8 == "blockwise" and config.fp8_quantize_before_gather
    fp8_summaries = lambda u: {
        k: float(v)
        for k, v in u[base_layer.SUMMARIES].items() if "fp8" in k
    }
    names = ("moe_fp8_fwd_scalar", "moe_fp8_dgrad_scalar", "moe_fp8_wgrad_scalar")
    assert fp8_summaries(upd) == dict.fromkeys(names, 1.0), fp8_summaries(upd)
    assert _rel(y, x + out.y) < 1e-6
    y_ref, config_ref, _, _ = _layer_and_block(_moe_tpl(**kw), variables, x, pad)
    assert config_ref.fp8 is None
    d = _rel(y - x, y_ref - x)
    assert 1e-3 < d < 0.1, d
    y_auto, _, _, upd = _layer_and_block(_moe_tpl(fp8="blockwise", **kw), variables, x, pad)
    assert fp8_summaries(upd) == dict.fromkeys(names, 0.0), fp8_summaries(upd)
    np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_ref))


def test_fp8_field_with_bad_dims_is_a_named_error():
    x, pad = _inputs(0)
    with pytest.raises(ValueError,
                       match=r"MoEFeedForward 'moe': MoEConfig.fp8='blockwise' is invalid: needs "
                       r"d_model and d_ff multiples of 128.*\(the layer's fp8='blockwise'\)"):
        _init_layer(_moe_tpl(gating_func="topk", fp8="blockwise"), x, pad)
