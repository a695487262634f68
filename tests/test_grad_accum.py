"""train.grad_accum_steps (experiments.train.microbatch): n micro-batches per optimizer step give the
step of one pass over the whole batch (loss, gradients, the expert-bias update, the expert
load) to float32 rounding, with no row moving between devices; a run stopped by SIGTERM at a
step boundary and resumed is bitwise the uninterrupted run; the FP8 expert weights are made
once per step, outside the micro-batch loop; bad values are one-line errors.

The model: a narrowed DeepSeek-V3-like Tiny (sigmoid scores, 4 expert groups of which 2 per
token, the expert bias moved at 0.01 a step, the per-sequence balance loss, 2 scanned MoE
layers) on 2 of the 8 host devices of tests/conftest.py, float32, 8 x 32 tokens a step."""

import dataclasses
import re
import warnings

import jax
import numpy as np
import pytest

from configs import base, experiments
from experiments.job import jobdir
from experiments.train import loop, microbatch, setup, steps
from experiments.train.metrics import read_metrics
from moe_praxis import update_expert_bias
from moe_praxis.ops.fp8 import recipe as fp8, weights as fp8_weights
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RATE = 0.01


class _DeepSeekLike(experiments.Tiny):
    BATCH_SIZE, SEQ_LEN = 8, 32
    REPEAT = True
    SCORE_FUNC = "sigmoid"
    NUM_EXPERT_GROUPS, GROUP_TOPK = 4, 2
    USE_EXPERT_BIAS, EXPERT_BIAS_UPDATE_RATE = True, RATE
    AUX_LOSS_TYPE = "sequence"  # a mean over sequences: it decomposes over micro-batches
    WARMUP_STEPS = 0
    CLIP_NORM = 0.0  # the Adam moments after one step are then the raw gradients'


def _with(prep, **train):
    exp = prep.config
    return dataclasses.replace(prep,
                               config=dataclasses.replace(exp,
                                                          train=dataclasses.replace(
                                                              exp.train, **train)))


@pytest.fixture(scope="module")
def runs():
    """(prepared n=1 experiment, its step functions, those of n=2), compiled once here."""
    prep = setup.prepare(_DeepSeekLike().experiment_config(), devices=jax.devices()[:2])
    fns = {n: steps.make_step_fns(_with(prep, grad_accum_steps=n)) for n in (1, 2)}
    return prep, fns


def _bias(state):
    return np.asarray(state["non_trainable"]["non_trainable"]["transformer"]["repeat"]["sub"]
                      ["x_layers_0"]["ff_layer"]["expert_bias"])


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}\(", text)) for op in ("all-to-all", "collective-permute")}


@pytest.mark.slow
def test_micro_batches_equal_one_step_on_the_whole_batch(runs):
    prep, fns = runs
    seed = _seed()
    got = {}
    with jax.set_mesh(prep.mesh):
        batch = steps.put_batch(prep.dataset.train_batch(seed % 10_000), fns[1].batch_sharding)
        for n, f in fns.items():
            state = f.init(jax.random.key(seed))  # (the step donates its state)
            compiled = f.train.lower(state, batch).compile()
            got[n] = (*compiled(state, batch), _collectives(compiled.as_text()))
    (s1, m1, c1), (s2, m2, c2) = got[1], got[2]
    msg = f"seed={seed}"
    # the micro-batches are every device's own rows: no data moves between devices for them
    assert c2 == c1, (c1, c2)
    for k in ("loss", "xent", "aux_loss", "grad_norm", "router_entropy"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=2e-6, err_msg=f"{k} {msg}")
    assert float(m1["aux_loss"]) > 0
    np.testing.assert_allclose(m2["expert_load"], m1["expert_load"], rtol=1e-6, err_msg=msg)
    # gradients: the first Adam moment is (1 - b1) g; float32 sums in another order agree to a
    # few ulps of the terms (rel. 1e-5 norm-wise per tensor: measured below 1e-6)
    adam = lambda s: s["opt_state"][0][0]  # (chain (adamw (scale_by_adam, ...)))
    leaves1 = jax.tree_util.tree_leaves_with_path(adam(s1).mu)
    leaves2 = jax.tree.leaves(adam(s2).mu)
    assert len(leaves1) == len(leaves2) > 10
    for (path, g1), g2 in zip(leaves1, leaves2):
        assert float(np.abs(g1).max()) > 0, path
        assert rel_err(g2, g1) < 1e-5, (jax.tree_util.keystr(path), rel_err(g2, g1), msg)
    # the expert bias moved once, by the rule on the whole step's counts: bitwise the same
    b1, b2 = _bias(s1), _bias(s2)
    assert b1.shape == (2, 8) and np.all(np.any(b1 != 0, axis=1)), b1
    assert set(np.unique(np.abs(b1))) <= {0.0, np.float32(RATE)}, b1
    np.testing.assert_array_equal(b2, b1, err_msg=msg)


def test_counts_are_summed_over_micro_batches_before_the_rule():
    """The rule on each micro-batch (applied twice, or the last one's alone) differs from the
    rule on the summed counts; expert_counts reads the counts back from the load fractions."""
    rng = np.random.default_rng(_seed())
    k, tokens, e = 2, 64, 8
    copies = np.float32(tokens * k)
    # two micro-batches of opposite skews: per micro-batch the signs differ from the sum's
    halves = [
        rng.multinomial(tokens * k, p)
        for p in (np.r_[[0.3] * 2, [0.4 / 6] * 6], np.r_[[0.4 / 6] * 6, [0.3] * 2])
    ]
    bias = rng.normal(size=(3, e)).astype(np.float32)
    nt = {"a": {"expert_bias": bias}, "other": np.zeros(2, np.float32)}
    counts = []
    for c in halves:
        load = np.float32(c) / copies
        summaries = {"a": {f"moe_expert_load_{i}_scalar": np.full(3, load[i]) for i in range(e)}}
        summaries["a"]["moe_routed_copies_scalar"] = np.full(3, copies)
        counts.append(microbatch.expert_counts(nt, summaries))
    np.testing.assert_array_equal(counts[0]["a"]["expert_bias"], np.tile(halves[0], (3, 1)))
    summed = jax.tree.map(lambda a, b: a + b, *counts)
    new = microbatch.update_biases(nt, summed, RATE)
    want = np.stack([update_expert_bias(b, halves[0] + halves[1], RATE) for b in bias])
    np.testing.assert_array_equal(new["a"]["expert_bias"], want)
    assert new["other"] is nt["other"]
    last = microbatch.update_biases(nt, counts[1], RATE)["a"]["expert_bias"]
    twice = microbatch.update_biases({"a": {"expert_bias": last}}, counts[0], RATE)
    assert np.any(np.asarray(last) != want) and np.any(twice["a"]["expert_bias"] != want)


@pytest.mark.slow
def test_sigterm_and_resume_at_a_step_boundary_is_bitwise(runs, tmp_path, monkeypatch):
    """Trainer runs with n=2 (the compiled step of the fixture): 4 steps uninterrupted; 2 steps
    then SIGTERM (saved), resumed to 4: the same losses, gradient norms and biases, bitwise."""
    prep, fns = runs
    monkeypatch.setattr(loop, "make_step_fns", lambda p: fns[2])
    common = dict(grad_accum_steps=2, num_steps=4, eval_every=4, checkpoint_every=0)
    ref = loop.Trainer(_with(prep, **common), tmp_path / "ref", progress=False).run()
    stopped = loop.Trainer(_with(prep, sigterm_at_step=2, **common),
                           tmp_path / "job",
                           progress=False).run()
    assert stopped["stopped_by"] == "SIGTERM" and stopped["final_step"] == 2, stopped
    resumed = loop.Trainer(_with(prep, **common), tmp_path / "job", progress=False).run()
    assert resumed["start_step"] == 2 and resumed["final_step"] == 4, resumed

    def train(job):
        return {
            (r["step"], k): r[k]
            for r in read_metrics(job / "metrics.jsonl") if r["kind"] == "train"
            for k in ("loss", "grad_norm", "max_mean_load_layer_0")
        }

    want, got = train(tmp_path / "ref"), train(tmp_path / "job")
    assert sorted(got) == sorted(want) and len(want) == 12
    assert got == want
    assert resumed["last_eval"] == ref["last_eval"]


def test_fp8_weights_are_made_once_per_step_outside_the_micro_batch_loop(monkeypatch):
    """TinyFp8 with n=2, traced: the expert weights quantized 6 times (2 layers x wi_gate,
    wi_up, wo) before the scan over the micro-batches, never inside it nor inside a layer."""

    class Fp8(experiments.TinyFp8):
        BATCH_SIZE, SEQ_LEN = 4, 16

    cfg = Fp8().experiment_config()
    cfg.train.grad_accum_steps = 2
    prep = setup.prepare(cfg, devices=jax.devices()[:1])
    depth, made, inside, loops = [0], [], [], []
    real_q, real_b, real_scan = fp8_weights.quantize, fp8.quantize_blocks, jax.lax.scan

    def scan(body, init, xs=None, *a, **k):
        loops.append(jax.tree.leaves(xs)[0].shape[0])
        depth[0] += 1
        try:
            return real_scan(body, init, xs, *a, **k)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(fp8_weights, "quantize",
                        lambda *a, **k: made.append(depth[0]) or real_q(*a, **k))
    monkeypatch.setattr(fp8, "quantize_blocks", lambda *a, **k: inside.append(1) or real_b(*a, **k))
    monkeypatch.setattr(jax.lax, "scan", scan)
    with warnings.catch_warnings(), jax.set_mesh(prep.mesh):
        warnings.simplefilter("ignore", RuntimeWarning)  # the FP8 emulation's notice
        f = steps.make_step_fns(prep)
        made.clear()  # (the abstract init quantizes inside the layers, as init does)
        inside.clear()
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=f.batch_sharding)
            for k, v in prep.dataset.train_batch(0).items() if k != "label_bytes"
        }
        jax.eval_shape(f.train, f.abstract_state, batch)
    assert loops == [2], loops  # one scan, over the 2 micro-batches
    assert made == [0] * 6 and inside == [], (made, inside)


def test_bad_values_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError,
                       match=r"^TrainConfig.grad_accum_steps=0 is invalid: must be a positive int"):
        base.TrainConfig(grad_accum_steps=0)
    cfg = experiments.tiny()
    cfg.data.batch_size, cfg.train.grad_accum_steps = 8, 2
    with pytest.raises(setup.ConfigError) as e:
        setup.prepare(cfg, load_data=False)  # 8 devices of the data axis: 1 row each
    assert str(e.value) == ("--fdl.train.grad_accum_steps=2 must divide the rows of each data "
                            "shard: data.batch_size=8 over the 8 devices of the token axes is 1 "
                            "per device (use a batch_size divisible by 16)")
    cfg.data.batch_size = 16
    assert setup.prepare(cfg, load_data=False).config.train.grad_accum_steps == 2
    monkeypatch.setattr(
        microbatch.models, "moe_layer_configs", lambda lm: [
            type("L",
                 (), dict(use_expert_bias=True, expert_bias_update_rate=r, num_experts_per_token=2))
            for r in (0.01, 0.02)
        ])
    with pytest.raises(setup.ConfigError,
                       match=r"one expert_bias_update_rate .* got \[0.01, 0.02\]"):
        setup.prepare(cfg, load_data=False)


def test_a_resumed_run_may_change_grad_accum_steps():
    a, b = experiments.tiny(), experiments.tiny()
    b.train.grad_accum_steps = 4
    assert jobdir.differences(a, b) == []
