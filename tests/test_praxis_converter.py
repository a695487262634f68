"""convert_gshard_params: Praxis GShard MoE weights into MoEFeedForward's, and the converted
layer and LM against Praxis's own (float32, 1e-5 relative: summation orders only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import MoEFeedForward, convert_gshard_params
from moe_praxis.praxis.gshard import GSHARD_PARAM_NAMES

from praxis import base_layer, pax_fiddle
from praxis.layers import activations

from tests.praxis_layer_util import (E, H, M, _init_layer, _inputs, _jit, _lm_apply, _lm_batch,
                                     _lm_init, _lm_tpl, _moe_tpl, _praxis_moe_tpl, _rel, _run_layer,
                                     _with_defaults)

# ----------------------------------------------------------------------------- converter


@pytest.mark.parametrize("gating_func,repeated", [("dense_top2", False), ("top2", False),
                                                  ("top2", True)])
def test_converted_lm_matches_praxis(gating_func, repeated):
    """The same LM with Praxis's GShard layer and with ours + converted weights."""
    # top2 with capacity factor E: capacity >= group size, so no token is dropped.
    kw = dict(unadjusted_expert_capacity_factor=float(E)) if gating_func == "top2" else {}
    ref_lm = base_layer.instantiate(
        _lm_tpl(_praxis_moe_tpl(**kw), repeated=repeated, gating_func=gating_func))
    our_lm = base_layer.instantiate(
        _lm_tpl(pax_fiddle.Config(MoEFeedForward, **kw), repeated=repeated,
                gating_func=gating_func))
    ref_params = _lm_init(ref_lm, seed=4)
    inp, tgt, pad = _lm_batch(jax.random.PRNGKey(5))
    ref_out = _jit(lambda p: _lm_apply(ref_lm, p, inp, tgt, pad)[0], ref_params)(ref_params)
    our_params = convert_gshard_params(ref_params)
    our_out = _jit(lambda p: _lm_apply(our_lm, p, inp, tgt, pad)[0], our_params)(our_params)
    assert ref_out.logits.dtype == jnp.float32
    assert _rel(our_out.logits, ref_out.logits) < 1e-5
    # The converted tree has exactly the structure our layer initialises.
    assert jax.tree.structure(our_params) == jax.tree.structure(_lm_init(our_lm, abstract=True))


@pytest.mark.parametrize(
    "kw,padded",
    [
        (dict(gating_func="top2", unadjusted_expert_capacity_factor=1.0), True),  # drops
        (dict(gating_func="top2", unadjusted_expert_capacity_factor=1.0, num_groups=2), False),
        (dict(gating_func="top2",
              expert_capacity_dim=3,
              unadjusted_expert_capacity_factor=0.0,
              num_groups=4,
              use_gated_activation=True,
              norm_policy="post",
              activation_tpl=pax_fiddle.Config(activations.SiLU)), True),
        (dict(gating_func="top2",
              unadjusted_expert_capacity_factor=0.5,
              min_group_size=16,
              num_groups=8,
              gating_logit_cap=2.0,
              norm_policy="primer_hybrid",
              activation_tpl=pax_fiddle.Config(activations.GELU),
              residual_weight=0.5), False),
        (dict(gating_func="dense_top2", apply_padding_first=True), True),
    ],
    ids=["top2-drops", "top2-groups", "top2-gated-cap-dim", "top2-min-group", "dense"])
def test_layer_matches_gshard(kw, padded):
    """Layer level, incl. drops: same outputs, dropped copies and aux loss as GShard.

    GShard's aux loss divides by all tokens of a group, padded or not; ours by the valid
    ones (padded tokens count in no statistic), so the aux loss is compared unpadded.
    """
    x, pad = _inputs(7, shape=(4, 8), pad_from=3 if padded else None)
    ref_tpl = _praxis_moe_tpl(**_with_defaults(kw))
    variables = _init_layer(ref_tpl, x, pad, seed=8)
    ref_y, ref_sum, ref_aux = _run_layer(ref_tpl, variables, x, pad)
    our_y, our_sum, our_aux = _run_layer(_moe_tpl(**kw),
                                         {"params": convert_gshard_params(variables["params"])}, x,
                                         pad)
    assert _rel(our_y, ref_y) < 1e-5
    if kw["gating_func"] != "top2":  # dense_top2 has no aux loss and no drops in Praxis
        return
    if not padded:
        np.testing.assert_allclose(our_aux["aux_moe_load_balance_loss"].value,
                                   ref_aux["aux_moe_load_balance_loss"].value,
                                   rtol=1e-5)
    # Praxis: fractions of valid tokens dispatched to 1 and 2 experts -> dropped copies.
    kept = float(ref_sum["dispatch_1_scalar"]) + 2 * float(ref_sum["dispatch_2_scalar"])
    dropped = float(our_sum["moe_dropped_token_fraction_scalar"])
    np.testing.assert_allclose(dropped, 1.0 - kept / 2, atol=1e-6)
    assert dropped > 0  # every case here has a binding capacity


def test_dense_top2_applies_the_logit_cap():
    """Praxis's dense_top2 ignores gating_logit_cap (its top2 applies it); ours applies it
    in both, so dense_top2 equals GShard top2 with the cap and no drops."""
    x, pad = _inputs(9, pad_from=2)
    kw = dict(gating_logit_cap=0.7, unadjusted_expert_capacity_factor=float(E))
    ref_tpl = _praxis_moe_tpl(**_with_defaults(dict(kw, gating_func="top2")))
    variables = _init_layer(ref_tpl, x, pad, seed=10)
    ref_y, _, _ = _run_layer(ref_tpl, variables, x, pad)
    params = convert_gshard_params(variables["params"])
    capped, _, _ = _run_layer(_moe_tpl(**kw, gating_func="dense_top2"), {"params": params}, x, pad)
    assert _rel(capped, ref_y) < 1e-5
    uncapped, _, _ = _run_layer(_moe_tpl(gating_func="dense_top2"), {"params": params}, x, pad)
    assert _rel(uncapped, ref_y) > 1e-3  # the cap matters at this scale


def test_converter_renames_and_validates():
    rng = np.random.default_rng(0)
    layer = {
        "gate": rng.normal(size=(2, M, E)),
        "wi_0": rng.normal(size=(2, E, M, H)),
        "wi_gate_0": rng.normal(size=(2, E, M, H)),
        "wo_0": rng.normal(size=(2, E, H, M)),
        "layer_norm": {
            "scale": rng.normal(size=(2, M)),
            "bias": rng.normal(size=(2, M))
        }
    }
    tree = {"lm": {"x_layers_1": {"ff_layer": layer}, "other": {"w": np.ones(3)}}}
    out = convert_gshard_params(tree)
    conv = out["lm"]["x_layers_1"]["ff_layer"]
    assert sorted(conv) == ["layer_norm", "router", "wi_gate", "wi_up", "wo"]
    for ours, theirs in (("router", "gate"), ("wi_up", "wi_0"), ("wi_gate", "wi_gate_0"), ("wo",
                                                                                           "wo_0")):
        np.testing.assert_array_equal(conv[ours], layer[theirs])
    assert out["lm"]["other"]["w"] is tree["lm"]["other"]["w"]
    bad = dict(layer, wo_0=rng.normal(size=(2, E, M, H)))
    with pytest.raises(ValueError, match=r"lm/ff_layer/wo_0 has shape"):
        convert_gshard_params({"lm": {"ff_layer": bad}})
    with pytest.raises(ValueError, match=r"same leading"):
        convert_gshard_params(dict(layer, gate=rng.normal(size=(M, E))))


def test_fuse_gate_up_layer_equals_unfused_with_converted_weights():
    """MoEFeedForward(fuse_gate_up=True) creates wi_gate_up [E, M, 2H] (no wi_gate / wi_up)
    and computes the unfused layer's function on convert_gshard_params(..., fuse_gate_up=True)
    of the unfused layer's weights (GShard names in between): y and the aux losses; a
    non-gated layer refuses both."""
    x, pad = _inputs(0, pad_from=5)
    kw = dict(use_gated_activation=True, gating_func="top2", router_z_loss_weight=0.1)
    unfused = _init_layer(_moe_tpl(**kw), x, pad)
    fused_vars = _init_layer(_moe_tpl(**kw, fuse_gate_up=True), x, pad)
    assert fused_vars["params"]["wi_gate_up"].shape == (E, M, 2 * H)
    assert "wi_gate" not in fused_vars["params"] and "wi_up" not in fused_vars["params"]
    to_gshard = {v: k for k, v in GSHARD_PARAM_NAMES.items()}
    gshard = {to_gshard.get(k, k): v for k, v in unfused["params"].items()}
    fused = dict(unfused, params=convert_gshard_params(gshard, fuse_gate_up=True))
    assert sorted(fused["params"]) == sorted(fused_vars["params"])
    y, _, aux = _run_layer(_moe_tpl(**kw), unfused, x, pad)
    yf, _, auxf = _run_layer(_moe_tpl(**kw, fuse_gate_up=True), fused, x, pad)
    assert _rel(yf, y) < 1e-5
    for name in aux:
        np.testing.assert_allclose(np.asarray(auxf[name].value),
                                   np.asarray(aux[name].value),
                                   rtol=1e-5,
                                   err_msg=name)
    with pytest.raises(ValueError, match="fuse_gate_up=True needs a gated layer"):
        convert_gshard_params({
            k: v
            for k, v in gshard.items() if k != "wi_gate_0"
        },
                              fuse_gate_up=True)
    with pytest.raises(ValueError, match="fuse_gate_up"):
        _init_layer(_moe_tpl(fuse_gate_up=True), x, pad)
