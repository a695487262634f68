"""MoEFeedForward's routing options, shared experts and the trained expert bias.

Each layer option is one MoEConfig field (moe_praxis.praxis.fields.CONFIG_FIELDS); the layer
with an option must compute exactly moe_block with the layer's MoEConfig on the layer-normed
input. Tolerance: float32 layer against float32 moe_block, 1e-6 relative (the same ops in the
same order; only XLA's fusion may differ).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import moe_block
from moe_praxis.praxis import fields
from praxis import base_layer
from tests.test_praxis_layer import E, _ctx, _init_layer, _inputs, _jit, _moe_tpl, _rel

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
]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: "-".join(sorted(kw)))
def test_layer_option_equals_moe_block(kw):
    """MoEFeedForward(gating_func='topk', option) = x + moe_block(layer_norm(x)) with the
    layer's MoEConfig, and each option reached that MoEConfig under the same name."""
    tpl = _moe_tpl(gating_func="topk", use_gated_activation=True, **kw)
    x, pad = _inputs(31, pad_from=5)
    variables = _variables(tpl, x, pad, seed=32)
    y, config, out, _ = _layer_and_block(tpl, variables, x, pad)
    for field, value in kw.items():
        config_field = {v: k for k, v in fields.CONFIG_FIELDS.items()}[field]
        assert getattr(config, config_field) == value, field
    assert _rel(y, x + out.y) < 1e-6
    if "capacity_factor" in kw:
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
