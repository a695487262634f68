"""fp8_gemms='auto' at few rows per expert: the bf16 layer where the weights' FP8 form would not
pay (ops.fp8.rule.form_pays, FORM_MIN_ROWS), in moe_block and in the experiments' train step.

A call below the rows runs exactly the bf16 block (bitwise: the same config with fp8=None) and
says so in MoEOutput.fp8_gemms; at the rows, with a form given, or with 'all' it runs FP8 (the
output differs from bf16 by the FP8 rounding). Rows are one device's: its tokens times top_k
over its experts, so the same T counts differently on a dp x ep mesh.
"""

import warnings

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import moe_praxis as mp
from configs import experiments
from experiments.train import setup, steps
from moe_praxis import expert_weights, ops
from moe_praxis.ops.fp8 import recipe as fp8, rule as fp8_rule, weights as fp8_weights
from moe_praxis.praxis import fp8_params
from tests.testutil import rel_err
from tests.testutil import seed as _seed

FP8_WEIGHTS = "fp8_weights"
WEIGHTS = ("wi_gate", "wi_up", "wo")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the FP8 emulation's notice
        yield


def test_form_pays_at_the_threshold_and_always_under_all_or_gemms_named():
    rows = fp8_rule.FORM_MIN_ROWS
    assert fp8_rule.form_pays("auto", rows) and not fp8_rule.form_pays("auto", rows - 1)
    assert fp8_rule.form_pays("all", 1) and fp8_rule.form_pays("fwd+dgrad", 1)
    with pytest.raises(ValueError,
                       match=r"fp8_gemms='some' is invalid; valid: 'auto', 'all', or "
                       r"GEMMs from \('fwd', 'dgrad', 'wgrad'\) joined by '\+'"):
        fp8_rule.form_pays("some", rows)
    assert str(rows) in ops.backend_info()["fp8_gemms"]["rule"]["layer"]


def _config(**kw):
    base = dict(d_model=256, d_ff=256, num_experts=4, top_k=2, kernel_backend="xla")
    return mp.MoEConfig(**{**base, **kw})


def _step(cfg, params, x, fws=None):
    """(loss, MoEOutput), (dparams, dx) of sum(y * cot) with the FP8 form `fws` given or not."""
    cot = jnp.cos(x)

    def loss(p, f, xx):
        o = mp.moe_block(p if f is None else {**p, FP8_WEIGHTS: f}, xx, cfg)
        return jnp.sum(o.y * cot), o

    return jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)(params, fws, x)


def test_block_below_the_rows_is_the_bf16_block_and_fp8_otherwise():
    """80 tokens, top-2 of 4 experts: 40 rows per expert. 'auto' quantizing its own weights runs
    the bf16 block bitwise (outputs, every gradient) and reports no FP8 GEMM; the same call
    with the FP8 form given runs the rule's choice (here the forwards) and with 'all' every
    GEMM in FP8, each differing from bf16 by more than 1e-3 and less than 0.1 (e4m3)."""
    seed = _seed()
    cfg = _config(fp8="blockwise")
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (2, 40, cfg.d_model), jnp.float32)
    (_, auto), g_auto = _step(cfg, params, x)
    (_, bf16), g_bf16 = _step(_config(), params, x)
    assert dict(auto.fp8_gemms) == dict.fromkeys(WEIGHTS, fp8_rule.NONE)
    assert bf16.fp8_gemms == ()
    for a, b in zip(jax.tree.leaves((auto.y, g_auto)), jax.tree.leaves((bf16.y, g_bf16))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    fws = mp.quantize_expert_weights(params, cfg)[FP8_WEIGHTS]
    (_, given), _ = _step(cfg, params, x, fws)
    (_, every), _ = _step(_config(fp8="blockwise", fp8_gemms="all"), params, x)
    assert dict(given.fp8_gemms) == cfg.fp8_choices()
    assert {c.label() for c in cfg.fp8_choices().values()} == {"fwd"}
    assert dict(every.fp8_gemms) == dict.fromkeys(WEIGHTS, fp8_rule.ALL)
    for out in (given, every):
        assert 1e-3 < rel_err(out.y, bf16.y) < 0.1, f"seed={seed}"


@pytest.mark.parametrize("tokens, fp8_runs", [(4096, True), (4094, False)])
def test_one_device_counts_its_rows_per_expert(tokens, fp8_runs):
    """E=2, top-1: 4096 tokens give 2048 rows per expert (FP8), 4094 give 2047 (bf16)."""
    cfg = _config(d_model=128, d_ff=128, num_experts=2, top_k=1, fp8="blockwise")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jax.ShapeDtypeStruct((tokens, cfg.d_model), jnp.float32)
    out = jax.eval_shape(lambda p, xx: mp.moe_block(p, xx, cfg), params, x)
    want = cfg.fp8_choices() if fp8_runs else dict.fromkeys(WEIGHTS, fp8_rule.NONE)
    assert dict(out.fp8_gemms) == want


@pytest.mark.parametrize("tokens, fp8_runs", [(8 * 2048, True), (8 * 2048 - 8, False)])
def test_a_dp_ep_mesh_counts_one_devices_rows(tokens, fp8_runs):
    """dp2 x ep4, 8 experts top-2: a device has T / 8 tokens and 2 experts, so T = 8 * 2048
    gives 2048 rows per local expert (FP8) and 8 tokens fewer 2047 (bf16); one device at the
    same T would have 4096 rows per expert."""
    cfg = _config(d_model=128, d_ff=128, num_experts=8, top_k=2, fp8="blockwise")
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "ep"))
    layout = mp.ep_bootstrap(mesh, mp.MeshResources(dp="dp", ep="ep"), cfg.num_experts)
    rows = expert_weights.rows_per_local_expert(tokens, layout, cfg.top_k)
    assert rows == tokens / 8 * 2 / 2
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jax.ShapeDtypeStruct((tokens, cfg.d_model), jnp.float32)
    out = jax.eval_shape(
        lambda p, xx: mp.moe_block(
            p, xx, cfg, mesh=mesh, resources=mp.MeshResources(dp="dp", ep="ep")), params, x)
    want = cfg.fp8_choices() if fp8_runs else dict.fromkeys(WEIGHTS, fp8_rule.NONE)
    assert dict(out.fp8_gemms) == want


class _TinyAuto(experiments.TinyFp8):
    FP8_GEMMS = "auto"
    BATCH_SIZE, SEQ_LEN = 4, 16


def _traced_train_step(monkeypatch, preset):
    """The quantizations a traced train step of `preset` makes: (outside the layers, inside)."""
    prep = setup.prepare(preset().experiment_config(), devices=jax.devices()[:1])
    made, inside = [], []
    real_q, real_b = fp8_weights.quantize, fp8.quantize_blocks
    monkeypatch.setattr(fp8_weights, "quantize", lambda *a, **k: made.append(1) or real_q(*a, **k))
    monkeypatch.setattr(fp8, "quantize_blocks", lambda *a, **k: inside.append(1) or real_b(*a, **k))
    with jax.set_mesh(prep.mesh):
        f = steps.make_step_fns(prep)
        made.clear()
        inside.clear()
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=f.batch_sharding)
            for k, v in prep.dataset.train_batch(0).items() if k != "label_bytes"
        }
        jax.eval_shape(f.train, f.abstract_state, batch)
    return prep, len(made), len(inside)


def test_the_train_step_makes_no_form_where_it_would_not_pay(monkeypatch):
    """Tiny with 'auto' (64 tokens a step: a few rows per expert): the traced train step makes
    no FP8 form and no layer quantizes (the bf16 layers run); with 'all' (TinyFp8) the step makes
    the form of every expert weight once. fp8_params.form_pays (what moe_praxis.step_fp8_weights
    asks) is the rule on the step's rows
    per local expert: the layer's tokens * top_k / experts, at and one token-row below 2048."""
    prep, made, inside = _traced_train_step(monkeypatch, _TinyAuto)
    assert (made, inside) == (0, 0)

    class Every(_TinyAuto):
        FP8_GEMMS = "all"

    _, made, inside = _traced_train_step(monkeypatch, Every)
    assert made > 0 and inside == 0
    layer = steps.fp8_layers(prep.model_config)[2]
    e, k = layer.num_experts, layer.num_experts_per_token
    at = fp8_rule.FORM_MIN_ROWS * e // k
    assert fp8_params.form_pays(layer, prep.mesh, at)
    assert not fp8_params.form_pays(layer, prep.mesh, at - e // k)


def test_the_docs_state_the_threshold_the_code_reads():
    """docs/config.md, docs/performance.md and MoEConfig's fp8_gemms doc name FORM_MIN_ROWS's
    value, so changing the constant without them fails here."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    want = f"fewer than {fp8_rule.FORM_MIN_ROWS} rows per expert"
    config_doc = " ".join(mp.MoEConfig.__doc__.split())
    for name, text in (("docs/config.md", (root / "docs/config.md").read_text()),
                       ("docs/performance.md", (root / "docs/performance.md").read_text()),
                       ("MoEConfig's docstring", config_doc)):
        assert want in " ".join(text.split()), name
