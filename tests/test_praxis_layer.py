"""MoEFeedForward (Praxis layer): a drop-in for Praxis's TransformerFeedForwardMoe (fields,
templates, training, remat policies, checkpoint names), its errors and its documentation.
The converter, the statistics and the sharding: test_praxis_converter.py,
test_praxis_layer_stats.py, test_praxis_layer_sharding.py; shared helpers:
tests/praxis_layer_util.py.

References are Praxis's own TransformerFeedForwardMoe (GShard) and float64 numpy formulas
written out here. Tolerances: float32 layers against each other, 1e-5 relative (the issue's
bar; the only differences are summation orders); float32 statistics against float64 numpy,
1e-5 relative.
"""

import contextlib
import dataclasses
import functools
import io
import re

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import MoEFeedForward
from moe_praxis.praxis import fields

from praxis import base_layer, pax_fiddle
from praxis.layers import activations, transformers
from praxis.layers.checkpoint_policy import AutodiffCheckpointType

from tests.praxis_layer_util import (B, DOCS, E, H, L, M, MOE_NAMES, _ctx, _init_layer, _inputs,
                                     _jit, _lm_apply, _lm_batch, _lm_init, _lm_tpl, _mesh_2x2,
                                     _moe_tpl, _praxis_moe_tpl, _rel, _with_defaults)

# ----------------------------------------------------------------------------- drop-in


def test_accepts_every_gshard_and_transformer_field():
    # Every field of Praxis's TransformerFeedForwardMoe (so a user's template converts by
    # changing the class) and every field Transformer / StackedTransformer / PaxML's
    # maybe_setup_moe_params write on the template.
    ours = {f.name for f in dataclasses.fields(MoEFeedForward)}
    gshard = {f.name for f in dataclasses.fields(transformers.TransformerFeedForwardMoe)}
    assert gshard - ours == set()
    written = {
        "input_dims", "hidden_dims", "num_experts", "num_groups", "min_group_size", "gating_func",
        "norm_policy", "relu_dropout_prob", "residual_dropout_prob", "residual_droppath_prob",
        "ln_tpl", "activation_tpl", "relu_dropout_tpl", "residual_dropout_tpl",
        "add_skip_connection", "use_gated_activation", "moe_load_balance_loss_weight",
        "gating_logit_cap"
    }
    assert written - ours == set()
    # A user's GShard template switches class in place and keeps working.
    tpl = _praxis_moe_tpl(**_with_defaults(dict(gating_func="top2", num_groups=2)))
    tpl.weight_split_dims_mapping.emh = ["data", None, "mdl"]
    fdl.update_callable(tpl, MoEFeedForward)
    x, pad = _inputs(1)
    params = _init_layer(tpl, x, pad)["params"]
    assert sorted(params) == ["layer_norm", "router", "wi_up", "wo"]
    # The sharding names TransformerLm.set_sharding_params_v1 writes.
    wp = {f.name for f in dataclasses.fields(MoEFeedForward.WeightSharding)}
    ap = {f.name for f in dataclasses.fields(MoEFeedForward.ActivationSharding)}
    assert {"me", "emh", "ehm"} <= wp
    assert {"gs", "gsm", "gsec", "gecs", "gec", "egcm", "egch", "gecm"} <= ap


def test_transformer_tr_fflayer_tpl_and_bf16():
    """As Transformer.tr_fflayer_tpl, with bfloat16 activations: runs, keeps the dtype, and
    the outputs match the float32 layer to bfloat16 precision."""
    outs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        ff = pax_fiddle.Config(MoEFeedForward,
                               num_experts=E,
                               gating_func="dense_top2",
                               use_gated_activation=True,
                               activation_tpl=pax_fiddle.Config(activations.SiLU))
        tpl = pax_fiddle.Config(transformers.Transformer,
                                name="xformer",
                                input_dims=M,
                                hidden_dims=H,
                                num_heads=2,
                                tr_fflayer_tpl=ff,
                                fprop_dtype=dtype)
        layer = base_layer.instantiate(tpl)
        x, pad = _inputs(21, pad_from=6)
        mask = jnp.zeros((B, 1, L, L), jnp.float32)

        def f(x, pad):
            with _ctx():
                v = layer.init(jax.random.PRNGKey(0), x, pad, attention_mask=mask)
                (y, _), upd = layer.apply(v,
                                          x,
                                          pad,
                                          attention_mask=mask,
                                          mutable=[base_layer.AUX_LOSS])
            return y, upd[base_layer.AUX_LOSS]

        xd = x.astype(dtype)
        outs[dtype] = _jit(f, xd, pad)(xd, pad)
        assert outs[dtype][0].dtype == dtype
        keys = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(outs[dtype][1])
        ]
        assert any("'ff_layer']['aux_moe_load_balance_loss'" in k for k in keys), keys
    y32, y16 = outs[jnp.float32][0], outs[jnp.bfloat16][0].astype(jnp.float32)
    assert _rel(y16, y32) < 3e-2


def test_extend_step_matches_call():
    """Decoding: extend_step on [B, M] equals __call__ on [B, 1, M] (dropless routing)."""
    tpl = _moe_tpl(gating_func="dense_top2", ici_mesh_shape=[2, 2], mesh_axis_names=["data", "mdl"])
    tpl.activation_split_dims_mapping.gsm = ["data", None, "mdl"]
    x, _ = _inputs(22, shape=(B, 1))
    variables = _init_layer(tpl, x, None)
    layer = base_layer.instantiate(tpl)

    def f(v, x):
        with _ctx():
            full = layer.apply(v, x)
            step = layer.apply(v, x[:, 0], time_step=0, method=layer.extend_step)
        return full, step

    with jax.set_mesh(_mesh_2x2()):
        full, step = _jit(f, variables, x)(variables, x)
    assert step.shape == (B, M)
    np.testing.assert_allclose(step, full[:, 0], rtol=1e-6, atol=1e-6)


def test_init_follows_gshard_variance_scaling():
    """uniform(+-sqrt(3 / fan_in)) like GShard's layer; normal(0, 1 / sqrt(fan_in)) if off."""
    big = dict(input_dims=64, hidden_dims=96, num_experts=8)
    x = jnp.zeros((2, 4, 64))
    for gshard_init in (True, False):
        v = _init_layer(_moe_tpl(**big, internal_gshard_variance_scaling_fan_in_init=gshard_init),
                        x, None)["params"]
        for name, fan_in in (("router", 64), ("wi_up", 64), ("wo", 96)):
            w = np.asarray(v[name], np.float64)
            np.testing.assert_allclose(w.std(), 1 / np.sqrt(fan_in), rtol=0.1, err_msg=name)
            bound = np.abs(w).max() * np.sqrt(fan_in)
            assert (bound <= np.sqrt(3.0)) if gshard_init else (bound > np.sqrt(3.0)), name
        # router_init_scale scales the router's init alone
        v = _init_layer(
            _moe_tpl(**big,
                     internal_gshard_variance_scaling_fan_in_init=gshard_init,
                     router_init_scale=0.1), x, None)["params"]
        for name, fan_in, scale in (("router", 64, 0.1), ("wi_up", 64, 1.0), ("wo", 96, 1.0)):
            w = np.asarray(v[name], np.float64)
            np.testing.assert_allclose(w.std(), scale / np.sqrt(fan_in), rtol=0.1, err_msg=name)


@pytest.mark.parametrize("repeated", [False, True], ids=["stacked", "repeated"])
def test_lm_trains(repeated):
    """TransformerLm with our layer at moe_layers=[1]: 30 Adam steps, the loss falls."""
    moe = pax_fiddle.Config(MoEFeedForward, router_z_loss_weight=1e-3)
    lm = base_layer.instantiate(_lm_tpl(moe, repeated=repeated))
    params = _lm_init(lm)
    ff = (params["transformer"]["repeat"]["sub"]
          if repeated else params["transformer"])["x_layers_1"]["ff_layer"]
    lead = (2, ) if repeated else ()
    assert {
        k: ff[k].shape
        for k in ("router", "wi_up", "wo")
    } == {
        "router": lead + (M, E),
        "wi_up": lead + (E, M, H),
        "wo": lead + (E, H, M)
    }
    losses, trained = _train(lm, params, steps=30)
    xent = np.array([l[1] for l in losses])
    aux = np.array([l[2] for l in losses])
    assert np.all(np.isfinite(xent)) and np.all(aux > 0)  # aux loss reaches total_loss
    assert xent[-5:].mean() < 0.5 * xent[:5].mean(), xent
    _assert_moe_weights_trained(params, trained)


def _assert_moe_weights_trained(before, after):
    paths = [
        p for p, _ in jax.tree_util.tree_leaves_with_path(before)
        if "'ff_layer'" in jax.tree_util.keystr(p) and any(f"'{n}'" in jax.tree_util.keystr(p)
                                                           for n in ("router", "wi_up", "wo"))
    ]
    assert len(paths) == 3
    get = lambda tree, path: functools.reduce(lambda t, k: t[k.key], path, tree)
    for path in paths:
        assert float(jnp.max(jnp.abs(get(after, path) - get(before, path)))) > 1e-4, path


def _train(lm, params, steps):
    """Adam(1e-2) steps on one fixed batch; returns ([(loss, xent, aux)], final params)."""
    opt = optax.adam(1e-2)
    state = opt.init(params)
    inp, tgt, pad = _lm_batch(jax.random.PRNGKey(100))

    def step(p, s):

        def loss_fn(p):
            out, _ = _lm_apply(lm, p, inp, tgt, pad)
            return out.total_loss, (out.avg_xent, out.aux_loss)

        (loss, (xent, aux)), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss, xent, aux

    step = _jit(step, params, state)
    out, p = [], params
    for _ in range(steps):
        p, state, loss, xent, aux = step(p, state)
        out.append((float(loss), float(xent), float(aux)))
    return out, p


def _saved(fn, *args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("repeated", [False, True], ids=["stacked", "repeated"])
def test_lm_remat_with_name_policy_trains_and_saves_our_residuals(repeated):
    """remat with SAVE_DOT_EXCEPT_LOGITS (save_only_these_names incl. ffn1, ffn2): our
    expert activation is saved (ffn2 is needed by no backward), and the LM trains."""
    moe = pax_fiddle.Config(MoEFeedForward)
    rows = B * L * 2  # token copies: B*L tokens, top-2 (dense FFN activations are [B, L, .])
    saved = {}
    for policy in (AutodiffCheckpointType.SAVE_DOT_EXCEPT_LOGITS,
                   AutodiffCheckpointType.SAVE_NOTHING):
        lm = base_layer.instantiate(_lm_tpl(moe, repeated=repeated, remat=True, policy=policy))
        params = _lm_init(lm, abstract=True)
        inp, tgt, pad = _lm_batch(jax.random.PRNGKey(1))
        saved[policy] = _saved(lambda p: _lm_apply(lm, p, inp, tgt, pad)[0].total_loss, params)
    if repeated:
        # Residuals saved inside the layer scan leave it stacked over the 2 repeats.
        want, never = f"f32[2,{rows},{H}] output of scan", f"f32[2,{rows},{M}] output of scan"
    else:
        want, never = f"f32[{rows},{H}] named 'ffn1'", f"f32[{rows},{M}] named 'ffn2'"
    assert any(want in l for l in saved[AutodiffCheckpointType.SAVE_DOT_EXCEPT_LOGITS]), want
    assert not any(want in l for l in saved[AutodiffCheckpointType.SAVE_NOTHING]), want
    # The routing weights are multiplied into ffn1 and the combine is a plain unpermute
    # (linear in ffn2), so no backward needs ffn2: it is never a residual.
    for policy in saved:
        assert not any(never in l for l in saved[policy]), (policy, never)
    lm = base_layer.instantiate(
        _lm_tpl(moe,
                repeated=repeated,
                remat=True,
                policy=AutodiffCheckpointType.SAVE_DOT_EXCEPT_LOGITS))
    params = _lm_init(lm)
    losses, trained = _train(lm, params, steps=30)
    xent = np.array([l[1] for l in losses])
    assert xent[-5:].mean() < 0.5 * xent[:5].mean(), xent
    _assert_moe_weights_trained(params, trained)


def test_moe_checkpoint_names_documented_and_saved():
    """save_only_these_names with the documented names saves exactly those residuals."""
    doc_names = re.findall(r"^\| `([a-z0-9_]+)` \| `\[", DOCS.read_text(), flags=re.M)
    assert sorted(doc_names) == sorted(MOE_NAMES)
    tpl = _moe_tpl(use_gated_activation=True, gating_func="dense_top2")
    x, pad = _inputs(3, pad_from=5)
    variables = _init_layer(tpl, x, pad)
    layer = base_layer.instantiate(tpl)

    def f(params, x):
        with _ctx():
            return jnp.sum(layer.apply({"params": params}, x, pad)**2)

    policy = jax.checkpoint_policies.save_only_these_names(*MOE_NAMES)
    lines = _saved(jax.checkpoint(f, policy=policy), variables["params"], x)
    found = {m.group(1) for l in lines for m in [re.search(r"named '([a-z0-9_]+)'", l)] if m}
    assert found == set(MOE_NAMES), lines
    lines = _saved(jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable),
                   variables["params"], x)
    assert not any("named" in l for l in lines), lines


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("field,value,match", [
    ("relu_dropout_prob", 0.1, r"relu_dropout_prob=0.1 is not supported: dropout"),
    ("gating_func", "expert_choice", r"gating_func='expert_choice'.*valid"),
    ("second_expert_policy", "sampling", r"second_expert_policy='sampling'"),
    ("moe_gating_embedding_level", "sentence", r"moe_gating_embedding_level='sentence'"),
    ("expert_weight_shards", 2, r"expert_weight_shards=2"),
    ("activation_tpl", pax_fiddle.Config(activations.Tanh), r"activation_tpl='Tanh'"),
    ("activation_tpl", pax_fiddle.Config(activations.GELU,
                                         approximate=False), r"approximate=False"),
    ("norm_policy", "sandwich", r"norm_policy='sandwich'.*valid"),
    ("num_experts", 0, r"num_experts=0 .*positive"),
    ("num_experts_per_token", 3, r"num_experts_per_token=3 .*'topk'"),
    ("mesh_resources", ("data", ), r"mesh_resources=\('data',\).*MeshResources or None"),
    ("unadjusted_expert_capacity_factor", 0.0, r"needs a capacity"),
    ("aux_loss_type", "zloss", r"aux_loss_type='zloss'.*valid"),
    ("kernel_backend", "tpu", r"kernel_backend='tpu'.*valid"),
    ("gating_logit_cap", -1.0, r"gating_logit_cap=-1.0"),
    ("residual_dropout_prob", 1.0, r"residual_dropout_prob=1.0"),
    ("ep_exchange", "nccl", r"MoEFeedForward 'moe': MoEConfig.ep_exchange='nccl'"),
    ("router_precision", "fp8", r"MoEConfig.router_precision='fp8'.*\(the layer's router_pr"),
    ("router_init_scale", 0.0, r"router_init_scale=0.0 is not supported: must be a finite "),
    ("router_init_scale", float("nan"), r"router_init_scale=nan is not supported"),
    ("router_init_scale", "small", r"router_init_scale='small' is not supported"),
])
def test_unsupported_fields_raise_at_setup(field, value, match):
    tpl = _moe_tpl(**{field: value})
    x, pad = _inputs(0)
    with pytest.raises(ValueError, match=match):
        _init_layer(tpl, x, pad)


def test_bad_sharding_rank_and_groups_raise():
    tpl = _moe_tpl()
    tpl.weight_split_dims_mapping.emh = ["data", "mdl"]
    x, pad = _inputs(0)
    with pytest.raises(ValueError, match=r"weight_split_dims_mapping.emh.*3 entries"):
        _init_layer(tpl, x, pad)
    tpl = _moe_tpl(gating_func="top2", num_groups=3)
    with pytest.raises(ValueError, match=r"num_groups=3 does not divide the 32 tokens"):
        _init_layer(tpl, x, pad)


# ----------------------------------------------------------------------------- docs


def test_docs_list_every_field_with_its_default():
    text = DOCS.read_text()
    rows = dict(re.findall(r"^\| `([a-z_0-9]+)` \| `([^`]*)` \|", text, flags=re.M))
    for f in dataclasses.fields(MoEFeedForward):
        if f.name in base_layer.BaseLayer.__dataclass_fields__ or f.name.endswith("_tpl"):
            continue
        assert f.name in rows, f"docs/praxis.md lacks field {f.name}"
        assert rows[f.name] == repr(f.default), (f.name, rows[f.name], f.default)
    assert set(fields.GATING_FUNCS) <= set(re.findall(r"'([a-z_0-9]+)'", text))


def test_router_precision_reaches_the_config():
    """The layer's router_precision is MoEConfig's (default 'auto': float32 on the CPU, bf16x3
    tensor-core GEMMs on a GPU)."""
    assert fields.build_config(base_layer.instantiate(_moe_tpl())).router_precision == "auto"
    cfg = fields.build_config(base_layer.instantiate(_moe_tpl(router_precision="bf16")))
    assert cfg.router_precision == "bf16"


def test_layer_defaults_are_moe_config_defaults_but_the_declared_gshard_overrides():
    """One declaration of the defaults: each MoEConfig field the layer maps
    (fields.CONFIG_FIELDS) has MoEConfig's default on the layer, except the GShard-compatible
    ones fields.GSHARD_OVERRIDES declares (and those are what the layer declares)."""
    config_defaults = {f.name: f.default for f in dataclasses.fields(moe_praxis.MoEConfig)}
    layer_defaults = {f.name: f.default for f in dataclasses.fields(MoEFeedForward)}
    for name, field in fields.CONFIG_FIELDS.items():
        want = fields.GSHARD_OVERRIDES.get(name, config_defaults[name])
        assert layer_defaults[field] == want, (name, field, layer_defaults[field], want)
    assert set(fields.GSHARD_OVERRIDES) <= set(fields.CONFIG_FIELDS)
