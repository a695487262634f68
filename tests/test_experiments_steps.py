"""Experiments' model and train step: the first k dense layers (unrolled and scanned), the
optimizer's clipping and schedules, and the mesh the MoE layer sees inside jit. In-process on
the 8 host devices of tests/conftest.py."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import moe_praxis
from configs import base, experiments, models
from experiments.train import setup, steps
from moe_praxis.praxis import compat
from moe_praxis.praxis.stack import DenseFirstRepeated


@pytest.mark.parametrize("repeat", [False, True], ids=["stacked", "repeated"])
def test_first_k_dense_layers(repeat):
    """FIRST_K_DENSE=1 on a 3-layer Tiny: layer 0 has a dense FFN (no router), layers 1 and 2
    are MoE, unrolled (moe_layers=[1, 2]) or as 1 dense layer + 2 scanned MoE repeats
    (DenseFirstRepeated); a train step's expert load has a NaN row for the dense layer."""

    class Dense1(experiments.Tiny):
        NUM_LAYERS, FIRST_K_DENSE, REPEAT = 3, 1, repeat
        BATCH_SIZE, SEQ_LEN = 8, 16
        USE_EXPERT_BIAS, EXPERT_BIAS_UPDATE_RATE = True, 0.5

    cfg = Dense1().experiment_config()
    st = cfg.model.stacked_transformer_tpl
    assert models.num_layers(cfg.model) == 3
    assert (st.__fn_or_cls__ is DenseFirstRepeated) == repeat
    prep = setup.prepare(cfg)
    fns = steps.make_step_fns(prep)
    params = fns.abstract_state["params"]["transformer"]
    if repeat:
        dense, moe = params["dense"]["x_layers_0"], params["repeat"]["sub"]["x_layers_0"]
        assert moe["ff_layer"]["router"].shape == (2, 128, 8)
        assert "dense" not in params["repeat"]["sub"]
    else:
        dense, moe = params["x_layers_0"], params["x_layers_1"]
        assert "router" in params["x_layers_2"]["ff_layer"]
    assert "router" not in dense["ff_layer"] and "router" in moe["ff_layer"]
    assert dense["ff_layer"]["ffn_layer1"]["linear"]["w"].shape == (128, 128)
    with jax.set_mesh(prep.mesh):
        state = fns.init(jax.random.key(0))
        new, m = fns.train(state, steps.put_batch(prep.dataset.train_batch(0), fns.batch_sharding))
    load = np.asarray(m["expert_load"])
    assert load.shape == (3, 8) and np.all(np.isnan(load[0]))
    np.testing.assert_allclose(load[1:].sum(1), 1.0, rtol=1e-5)
    # every MoE layer's expert bias took one step of the rule on its own load (+-0.5 or 0)
    nt = new["non_trainable"]["non_trainable"]["transformer"]
    bias = np.asarray((nt["repeat"]["sub"]["x_layers_0"] if repeat else {
        "ff_layer": {
            "expert_bias": np.stack(
                [nt[f"x_layers_{l}"]["ff_layer"]["expert_bias"] for l in (1, 2)])
        }
    })["ff_layer"]["expert_bias"])
    assert bias.shape == (2, 8)
    np.testing.assert_array_equal(bias, 0.5 * np.sign(load[1:].mean(1, keepdims=True) - load[1:]))
    with pytest.raises(ValueError,
                       match=r"first_k_dense=4 is invalid: an int in \[0, num_layers=3\]"):
        models.transformer_lm(model_dims=8,
                              hidden_dims=8,
                              num_layers=3,
                              num_heads=2,
                              num_experts=2,
                              first_k_dense=4)


def test_optimizer_clips_and_schedules():
    opt = base.OptimizerConfig(learning_rate=1.0,
                               warmup_steps=10,
                               schedule="cosine",
                               end_lr_fraction=0.1,
                               clip_norm=0.5,
                               weight_decay=0.0)
    _, sched = steps.make_optimizer(opt, num_steps=110)
    assert float(sched(0)) == 0.0 and abs(float(sched(10)) - 1.0) < 1e-6
    assert abs(float(sched(60)) - (0.1 + 0.9 * 0.5)) < 1e-5  # half way down the cosine
    assert abs(float(sched(110)) - 0.1) < 1e-6
    # Adam's first step is -lr * g / (|g| + eps) elementwise; with eps = 1 it depends on the
    # scale of g, so it shows whether g was clipped to global norm 0.5 first.
    opt = base.OptimizerConfig(learning_rate=0.5,
                               warmup_steps=0,
                               schedule="constant",
                               eps=1.0,
                               clip_norm=0.5,
                               weight_decay=0.0)
    tx, sched = steps.make_optimizer(opt, num_steps=10)
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.array([3.0, 4.0])}  # global norm 5
    upd, _ = tx.update(g, tx.init(params), params)
    lr0 = float(sched(0))
    gc = np.array([3.0, 4.0]) * 0.5 / 5.0
    np.testing.assert_allclose(np.asarray(upd["w"]), -lr0 * gc / (np.abs(gc) + 1.0), rtol=1e-5)
    assert lr0 > 0


@pytest.mark.parametrize("mu_dtype", ["float32", "bfloat16"])
def test_adamw_keeps_its_first_moment_in_mu_dtype(mu_dtype):
    """Six steps of the optimizer on fresh random gradients equal a float64 AdamW whose first
    moment is rounded to mu_dtype after each step (the second moment and the update float32):
    the moment is stored in mu_dtype, never computed in it (optax's own bfloat16 mu_dtype, which
    multiplies by b1 in bfloat16, differs from this reference by 2e-3). Each step starts from the
    moment the optimizer stored, and a bfloat16 moment must be the rounding of a value within
    float32's error (1e-6 of the terms summed) of the exact one."""
    opt = base.OptimizerConfig(learning_rate=0.1,
                               warmup_steps=0,
                               schedule="constant",
                               clip_norm=0.0,
                               weight_decay=0.1,
                               mu_dtype=mu_dtype)
    tx, _ = steps.make_optimizer(opt, num_steps=10)
    rng = np.random.default_rng()
    p0 = rng.standard_normal((64, 32)).astype(np.float32)
    params = {"w": jnp.asarray(p0)}
    state = tx.init(params)

    def moment(st, name):
        return np.asarray(optax.tree_utils.tree_get(st, name)["w"], np.float64)

    assert optax.tree_utils.tree_get(state, "mu")["w"].dtype == jnp.dtype(mu_dtype)
    assert optax.tree_utils.tree_get(state, "nu")["w"].dtype == jnp.float32
    p, mu, nu = p0.astype(np.float64), np.zeros_like(p0, np.float64), np.zeros_like(p0, np.float64)
    update = jax.jit(tx.update)
    for t in range(1, 7):
        g = rng.standard_normal(p0.shape).astype(np.float32)
        upd, state = update({"w": jnp.asarray(g)}, state, params)
        params = {"w": params["w"] + upd["w"]}
        scale = opt.b1 * np.abs(mu) + (1 - opt.b1) * np.abs(g)  # float32 sums err relative to this
        mu = opt.b1 * mu + (1 - opt.b1) * g
        nu = opt.b2 * nu + (1 - opt.b2) * g.astype(np.float64)**2
        step = (mu / (1 - opt.b1**t)) / (np.sqrt(nu / (1 - opt.b2**t)) + opt.eps)
        p = p - opt.learning_rate * (step + opt.weight_decay * p)
        got = moment(state, "mu")
        if mu_dtype == "bfloat16":
            _assert_rounded_to_bfloat16(got, mu, scale, t)
        else:
            np.testing.assert_allclose(got, mu, rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(params["w"]), p, rtol=0, atol=2e-5)
        mu = got


def _assert_rounded_to_bfloat16(got, exact, scale, t):
    """got is the bfloat16 rounding of a value within 1e-6 x scale of exact: the size of the
    terms summed bounds float32's error in the sum, and where they cancel that error can span
    several bfloat16 steps of a small moment. Rounding to nearest is monotone, so the accepted
    values are those from the rounding of exact - err to that of exact + err."""
    err = 1e-6 * scale
    lo = np.asarray(jnp.asarray(exact - err, jnp.bfloat16), np.float64)
    hi = np.asarray(jnp.asarray(exact + err, jnp.bfloat16), np.float64)
    ok = (got >= lo) & (got <= hi)
    assert ok.all(), (f"step {t}: {int((~ok).sum())} first-moment entries are not the bfloat16 "
                      f"rounding of the exact average, e.g. got {got[~ok][:3]}, exact "
                      f"{exact[~ok][:3]}")


def test_current_mesh_inside_jit_is_the_concrete_mesh():
    """The trainer jits under jax.set_mesh; the MoE layer asks compat.current_mesh() while
    traced, where jax.sharding.get_mesh() refuses to run."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    seen = []

    def f(x):
        seen.append(compat.current_mesh())
        return x + 1

    with jax.set_mesh(mesh):
        jax.jit(f)(jnp.zeros(8))
    assert seen[0] == mesh and isinstance(seen[0], jax.sharding.Mesh)
    jax.jit(f)(jnp.ones(8))
    assert seen[1] is None


def test_cast_expert_weights_casts_the_routed_expert_weights_only():
    """Separate and fused (wi_gate_up) expert weights, stacked or not, at any depth, are cast;
    the router, the expert bias and every other parameter keep their dtype."""
    f32 = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    params = {
        "emb": f32(4, 8),
        "a": {
            "ff_layer": {
                "router": f32(8, 4),
                "expert_bias": f32(4),
                "wi_gate": f32(4, 8, 6),
                "wi_up": f32(4, 8, 6),
                "wo": f32(4, 6, 8)
            },
            "attn": {
                "w": f32(8, 8)
            }
        },
        "repeat": {
            "ff_layer": {
                "router": f32(2, 8, 4),
                "wi_gate_up": f32(2, 4, 8, 12),
                "wo": f32(2, 4, 6, 8)
            }
        },
    }
    got = moe_praxis.cast_expert_weights(params, "bfloat16")
    cast = {("a", "ff_layer", n) for n in ("wi_gate", "wi_up", "wo")}
    cast |= {("repeat", "ff_layer", n) for n in ("wi_gate_up", "wo")}
    for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
        key = tuple(k.key for k in path)
        assert leaf.dtype == (jnp.bfloat16 if key in cast else jnp.float32), key
    assert jax.tree.structure(got) == jax.tree.structure(params)


def _expert_weight_casts(fn, *args) -> collections.Counter:
    """{shape: number} of the float32 -> bfloat16 casts of arrays of 3 or more dims in the jaxpr
    of fn(*args), sub-jaxprs (scan bodies, rematerialized blocks, the backward) included."""
    found = collections.Counter()

    def walk(jaxpr):
        for eq in jaxpr.eqns:
            if eq.primitive.name == "convert_element_type":
                a = eq.invars[0].aval
                if (a.dtype == jnp.float32 and eq.params["new_dtype"] == jnp.bfloat16
                        and a.ndim >= 3):
                    found[tuple(a.shape)] += 1
            for p in eq.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_all_gemms"])
def test_cast_weights_once_casts_each_expert_weight_once_with_the_same_step(fp8):
    """train.cast_weights_once (the default) on a scanned, rematerialized bfloat16 Tiny: the
    step's jaxpr casts each stacked expert weight [L, E, M, H] to bfloat16 once, and its layer
    slices [E, M, H] no longer in the forward and again in the recomputation; one step from
    the same state gives the same loss, gradient norm and update. With blockwise FP8 on every
    expert GEMM (the step's FP8 form of the weights beside the cast ones) the step is the same
    too."""

    class Scanned(experiments.TinyFp8 if fp8 else experiments.Tiny):
        REPEAT, REMAT, FPROP_DTYPE = True, True, "bfloat16"
        BATCH_SIZE, SEQ_LEN = 8, 16
        if fp8:
            FP8_GEMMS = "all"

    results, casts = [], []
    for once in (False, True):
        cfg = Scanned().experiment_config()
        cfg.train.cast_weights_once = once
        # Adam's first step with a large eps is -lr * g / (|g| + eps): the update shows g
        cfg.optimizer = base.OptimizerConfig(learning_rate=1.0,
                                             warmup_steps=0,
                                             schedule="constant",
                                             eps=1e3,
                                             clip_norm=0.0,
                                             weight_decay=0.0)
        setup.resolve_lengths(cfg)
        prep = setup.prepare(cfg)
        fns = steps.make_step_fns(prep)
        moe = fns.abstract_state["params"]["transformer"]["repeat"]["sub"]["x_layers_0"]
        stacked = collections.Counter(
            tuple(moe["ff_layer"][n].shape) for n in ("wi_gate", "wi_up", "wo"))
        with jax.set_mesh(prep.mesh):
            state = fns.init(jax.random.key(0))
            batch = steps.put_batch(prep.dataset.train_batch(0), fns.batch_sharding)
            casts.append(_expert_weight_casts(fns.train, state, batch))
            before = jax.tree.map(lambda a: np.asarray(a, np.float64), state["params"])
            new, m = fns.train(state, batch)  # donates state
        delta = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, new["params"], before)
        results.append((float(m["loss"]), float(m["grad_norm"]), delta))
    for shape, n in (() if fp8 else stacked.items()):  # n expert weights of this shape
        assert (casts[0][shape], casts[1][shape]) == (0, n), (shape, n, casts)
        # the slices' casts in the forward and in the recomputation are gone (the backward's
        # cast of each weight's gradient to the weight's dtype stays, in both)
        assert casts[0][shape[1:]] - casts[1][shape[1:]] == 2 * n, (shape, n, casts)
    (loss0, norm0, d0), (loss1, norm1, d1) = results
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0) and abs(norm1 - norm0) <= 1e-4 * norm0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(d0)[0], jax.tree.leaves(d1)):
        err = np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-30)
        assert err < 1e-3, (jax.tree_util.keystr(path), err)
