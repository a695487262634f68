"""MoEFeedForward (Praxis layer) and convert_gshard_params.

References are Praxis's own TransformerFeedForwardMoe (GShard) and float64 numpy formulas
written out here. Tolerances: float32 layers against each other, 1e-5 relative (the issue's
bar; the only differences are summation orders); float32 statistics against float64 numpy,
1e-5 relative.
"""

import contextlib
import dataclasses
import functools
import io
import pathlib
import re

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import MoEFeedForward, convert_gshard_params
from moe_praxis.praxis import fields
from moe_praxis.praxis.gshard import GSHARD_PARAM_NAMES
from praxis import base_layer, pax_fiddle, py_utils
from praxis.layers import activations, transformer_models, transformers
from praxis.layers.checkpoint_policy import AutodiffCheckpointType

V, M, H, E, B, L = 32, 16, 24, 4, 4, 8
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "praxis.md"
MOE_NAMES = ("moe_router_logits", "moe_dispatched", "moe_gate", "moe_up", "ffn1", "ffn2")

# XLA:CPU compile time dominates these tests (tiny shapes); LLVM's optimisation level does
# not change results, only speed.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _ctx():
    return base_layer.JaxContext.new_context()


def _jit(f, *args):
    """f(*args) through jit, compiled with _FAST_COMPILE; returns the compiled function."""
    return jax.jit(f).lower(*args).compile(_FAST_COMPILE)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _moe_tpl(cls=MoEFeedForward, **kw):
    kw.setdefault("name", "moe")
    kw.setdefault("input_dims", M)
    kw.setdefault("hidden_dims", H)
    kw.setdefault("num_experts", E)
    kw.setdefault("num_groups", 1)
    return pax_fiddle.Config(cls, **kw)


def _run_layer(tpl, variables, x, paddings):
    """Applies one layer; returns (y, summaries, aux_losses)."""
    layer = base_layer.instantiate(tpl)

    def f(variables, x, paddings):
        with _ctx():
            y, upd = layer.apply(variables,
                                 x,
                                 paddings,
                                 mutable=[base_layer.SUMMARIES, base_layer.AUX_LOSS])
        return y, upd.get(base_layer.SUMMARIES, {}), upd.get(base_layer.AUX_LOSS, {})

    return _jit(f, variables, x, paddings)(variables, x, paddings)


def _init_layer(tpl, x, paddings, seed=0):
    layer = base_layer.instantiate(tpl)

    def f(key, x, paddings):
        with _ctx():
            return layer.init(key, x, paddings)

    key = jax.random.PRNGKey(seed)
    return _jit(f, key, x, paddings)(key, x, paddings)


def _inputs(seed, shape=(B, L), pad_from=None):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape + (M, ), jnp.float32)
    pad = np.zeros(shape, np.float32)
    if pad_from is not None:
        pad[-1, pad_from:] = 1.0
    return x, jnp.asarray(pad)


# ----------------------------------------------------------------------------- LM helpers


def _lm_tpl(moe_tpl, *, repeated=False, remat=False, policy=None, gating_func="dense_top2"):
    st = pax_fiddle.Config(transformers.StackedTransformer,
                           num_layers=2,
                           moe_layers=[1],
                           model_dims=M,
                           hidden_dims=H,
                           num_heads=2,
                           num_experts=E,
                           num_groups=1,
                           gating_func=gating_func,
                           moe_layer_tpl=moe_tpl,
                           remat=remat and not repeated)
    if repeated:  # the repeat layer always remats each block, with its checkpoint_policy
        st = pax_fiddle.Config(transformers.StackedTransformerRepeated, block=st, x_times=2)
    if policy is not None:
        st.checkpoint_policy = policy
    return pax_fiddle.Config(transformer_models.TransformerLm,
                             name="lm",
                             model_dims=M,
                             vocab_size=V,
                             stacked_transformer_tpl=st)


def _lm_batch(key):
    """Learnable synthetic sequences: token[i+1] = token[i] + 3 (mod V), random start."""
    start = jax.random.randint(key, (B, 1), 0, V)
    ids = (start * 5 + 3 * jnp.arange(L + 1)[None]) % V
    pad = jnp.zeros((B, L), jnp.float32).at[-1, L - 2:].set(1.0)  # some padding
    return ids[:, :-1], ids[:, 1:], pad


def _lm_apply(lm, params, inp, tgt, pad):
    labels = py_utils.NestedMap(class_ids=tgt, class_weights=1.0 - pad)
    with _ctx():
        out, upd = lm.apply({"params": params},
                            inp,
                            pad,
                            labels=labels,
                            mutable=[base_layer.AUX_LOSS, base_layer.SUMMARIES])
    return out, upd


def _lm_init(lm, seed=0, abstract=False):
    inp, tgt, pad = _lm_batch(jax.random.PRNGKey(seed))
    labels = py_utils.NestedMap(class_ids=tgt, class_weights=1.0 - pad)

    def init(key):
        with _ctx():
            return lm.init(key, inp, pad, labels=labels)["params"]

    key = jax.random.PRNGKey(seed)
    if abstract:
        return jax.eval_shape(init, key)
    return _jit(init, key)(key)


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


# ----------------------------------------------------------------------------- converter


def _praxis_moe_tpl(**kw):
    return pax_fiddle.Config(transformers.TransformerFeedForwardMoe, **kw)


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


def _with_defaults(kw):
    out = dict(name="moe", input_dims=M, hidden_dims=H, num_experts=E, num_groups=1)
    out.update(kw)
    return out


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


# ----------------------------------------------------------------------------- statistics


def _reference_stats(x, router, pad, *, k, aux_coeff, z_coeff):
    """float64 numpy: GShard aux loss, z-loss, load, entropy over valid tokens."""
    x2 = np.asarray(x, np.float64).reshape(-1, M)
    valid = np.asarray(pad).reshape(-1) < 0.5
    logits = x2 @ np.asarray(router, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    pv, idv = p[valid], ids[valid]
    n = valid.sum()
    counts = np.array([(idv == e).sum() for e in range(E)], np.float64)
    f1 = np.array([(idv[:, 0] == e).sum() for e in range(E)], np.float64)
    aux = aux_coeff * E / n**2 * np.sum(pv.sum(0) * f1)
    lse = np.log(np.exp(logits[valid]).sum(-1))
    return dict(aux=aux,
                z=z_coeff * np.mean(lse**2),
                load=counts / (n * k),
                entropy=np.mean(-(pv * np.log(pv)).sum(-1)))


@pytest.mark.parametrize("gating_func", ["dense_top2", "topk"])
def test_summaries_and_aux_losses_skip_padded_tokens(gating_func):
    k = 2 if gating_func == "dense_top2" else 3
    tpl = _moe_tpl(gating_func=gating_func,
                   num_experts_per_token=k,
                   norm_policy="post",
                   moe_load_balance_loss_weight=0.3,
                   router_z_loss_weight=0.02)
    x, pad = _inputs(11, pad_from=3)
    variables = _init_layer(tpl, x, pad, seed=12)
    # Padded tokens get huge inputs: they must not move any statistic.
    x = jnp.where(pad[..., None] > 0, 50.0 * x, x)
    _, summ, aux = _run_layer(tpl, variables, x, pad)
    ref = _reference_stats(x, variables["params"]["router"], pad, k=k, aux_coeff=0.3, z_coeff=0.02)
    np.testing.assert_allclose(aux["aux_moe_load_balance_loss"].value, ref["aux"], rtol=1e-5)
    np.testing.assert_allclose(aux["aux_moe_z_loss"].value, ref["z"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_aux_loss_scalar"], ref["aux"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_z_loss_scalar"], ref["z"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_router_entropy_scalar"], ref["entropy"], rtol=1e-5)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    np.testing.assert_allclose(load, ref["load"], rtol=1e-6)
    assert float(summ["moe_dropped_token_fraction_scalar"]) == 0.0
    # docs/praxis.md lists exactly the summaries the layer writes.
    documented = set(re.findall(r"^\| `(moe_[a-z_{}]+)` \| [a-z]", DOCS.read_text(), flags=re.M))
    written = {re.sub(r"_\d+$", "_{e}", k[:-len("_scalar")]) for k in summ}
    assert written == documented


def test_gshard_group_statistics_are_the_groups_means():
    """'top2' with num_groups=2: the aux loss, z-loss and router entropy are the means of the
    two groups' values (float64 references per group), the loads count both groups."""
    tpl = _moe_tpl(gating_func="top2",
                   num_groups=2,
                   unadjusted_expert_capacity_factor=float(E),
                   norm_policy="post",
                   moe_load_balance_loss_weight=0.3,
                   router_z_loss_weight=0.02)
    x, pad = _inputs(25)
    variables = _init_layer(tpl, x, pad, seed=26)
    _, summ, aux = _run_layer(tpl, variables, x, pad)
    x2, p2 = np.asarray(x).reshape(-1, M), np.asarray(pad).reshape(-1)
    half = x2.shape[0] // 2
    refs = [
        _reference_stats(x2[g * half:(g + 1) * half],
                         variables["params"]["router"],
                         p2[g * half:(g + 1) * half],
                         k=2,
                         aux_coeff=0.3,
                         z_coeff=0.02) for g in range(2)
    ]
    mean = lambda key: np.mean([r[key] for r in refs], axis=0)
    np.testing.assert_allclose(aux["aux_moe_load_balance_loss"].value, mean("aux"), rtol=1e-5)
    np.testing.assert_allclose(summ["moe_z_loss_scalar"], mean("z"), rtol=1e-5)
    np.testing.assert_allclose(summ["moe_router_entropy_scalar"], mean("entropy"), rtol=1e-5)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    np.testing.assert_allclose(load, mean("load"), rtol=1e-6)  # equal groups: mean = pooled


def test_padded_tokens_route_nowhere_even_with_capacity():
    # Padding first in token order, tight capacity: padded tokens would take the capacity
    # of the valid ones if they were routed.
    tpl = _moe_tpl(gating_func="top2",
                   unadjusted_expert_capacity_factor=1.0,
                   add_skip_connection=False)
    x, _ = _inputs(13)
    pad = jnp.zeros((B, L)).at[0, :5].set(1.0)
    variables = _init_layer(tpl, x, pad, seed=14)
    ys = [
        _run_layer(tpl, variables, jnp.where(pad[..., None] > 0, s * x, x), pad)[0]
        for s in (1.0, -30.0)
    ]
    np.testing.assert_array_equal(np.asarray(ys[0])[np.asarray(pad) > 0], 0.0)
    np.testing.assert_allclose(ys[0], ys[1], rtol=0, atol=1e-6)
    _, summ, _ = _run_layer(tpl, variables, x, pad)
    assert float(summ["moe_dropped_token_fraction_scalar"]) > 0  # the capacity binds


def test_skewed_routing_drops_and_loads():
    # Every token's first choice is expert 2 and its second expert 0 (norm_policy='post':
    # the router sees the raw, positive inputs): loads follow, the capacity drops half.
    tpl = _moe_tpl(gating_func="top2", unadjusted_expert_capacity_factor=2.0, norm_policy="post")
    x, pad = _inputs(15)
    x = jnp.abs(x) + 0.1
    variables = _init_layer(tpl, x, pad, seed=16)
    router = np.zeros((M, E), np.float32)
    router[:, 2], router[:, 0] = 1.0, 0.5
    params = dict(variables["params"], router=jnp.asarray(router))
    _, summ, _ = _run_layer(tpl, {"params": params}, x, pad)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    assert load == [0.5, 0.0, 0.5, 0.0]
    # T = 32 tokens, capacity round4(int(32 * 2 / 4)) = 16 per expert: 32 of 64 copies kept.
    np.testing.assert_allclose(float(summ["moe_dropped_token_fraction_scalar"]), 0.5)


def test_all_tokens_padded():
    tpl = _moe_tpl(gating_func="top2", router_z_loss_weight=0.1)
    x, _ = _inputs(18)
    pad = jnp.ones((B, L))
    variables = _init_layer(tpl, x, pad)
    y, summ, aux = _run_layer(tpl, variables, x, pad)
    np.testing.assert_array_equal(y, x)  # the MoE branch adds exactly zero
    assert float(aux["aux_moe_load_balance_loss"].value) == 0.0
    assert float(aux["aux_moe_z_loss"].value) == 0.0
    assert all(float(summ[f"moe_expert_load_{e}_scalar"]) == 0.0 for e in range(E))
    assert all(np.isfinite(float(v)) for v in summ.values())


# ----------------------------------------------------------------------------- sharding


def _mesh_2x2():
    return jax.make_mesh((2, 2), ("data", "mdl"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 2)


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


_EP_AXES = ("data", "fsdp", "expert")  # DP2 x FSDP2 x EP2 on the 8 CPU devices


def _ep_tpl(emh="unset", ehm="unset", me="unset", shape=(2, 2, 2), **kw):
    """A layer with mesh_resources AND its own mesh (ici_mesh_shape / mesh_axis_names), 8
    experts; letters not given stay unset (None)."""
    from moe_praxis import MeshResources

    kw.setdefault("num_experts", 8)
    kw.setdefault("gating_func", "dense_top2")
    tpl = _moe_tpl(mesh_resources=MeshResources(dp="data", fsdp="fsdp", ep="expert"),
                   ici_mesh_shape=list(shape),
                   mesh_axis_names=list(_EP_AXES),
                   **kw)
    for letter, value in (("emh", emh), ("ehm", ehm), ("me", me)):
        if value != "unset":
            setattr(tpl.weight_split_dims_mapping, letter, value)
    return tpl


def _weight_specs(tpl):
    layer = base_layer.instantiate(tpl)
    x, pad = _inputs(0)
    with _ctx():
        return base_layer.var_partition_specs(layer.abstract_init_with_metadata(x, pad),
                                              mesh_shape=tpl.ici_mesh_shape,
                                              device_axis_names=tpl.mesh_axis_names)["params"]


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
    """The layer's router_precision is MoEConfig's (default float32: the logits GEMM as before)."""
    assert fields.build_config(base_layer.instantiate(_moe_tpl())).router_precision == "float32"
    cfg = fields.build_config(base_layer.instantiate(_moe_tpl(router_precision="bf16")))
    assert cfg.router_precision == "bf16"
