"""ops.routing_table, the one list of the router's choices: a new row reaches the config's
validation, the op's reference, the tests' float64 reference and the generated docs with no
other edit; an unknown name is an error everywhere; the alias; the kernel modes; the docs.

Tolerance: the op (float32) against float64 math written out here, 1e-6 relative (norm-wise):
one softplus, one sum and one division per weight, each a few float32 ulps."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import config, routing
from moe_praxis.ops import backend, router, routing_table
from moe_praxis.ops.swiglu import ACTIVATIONS as SWIGLU_ACTIVATIONS
from tests import kernel_reference as ref
from tests.testutil import rel_err
from tests.testutil import seed as _seed

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = "softplus_probe"


@pytest.fixture
def probe_row(monkeypatch):
    """A throwaway score function, s = softplus(logits), added to the table in-process only."""
    sum_to_one = lambda s: s / jnp.sum(s, axis=-1, keepdims=True)
    row = routing_table.Choice(PROBE, True, jax.nn.softplus, sum_to_one, lambda logits, s: s,
                               routing_table.scores_at_ids, None, "top-k of `softplus(logits) + b`",
                               "`s[ids]`", "a test's probe")
    monkeypatch.setitem(routing_table.CHOICES, (PROBE, True), row)
    return row


def _softplus_routing64(logits, k, norm_topk):
    """The probe's routing written out in NumPy float64: ids, weights, probs."""
    x = np.asarray(logits, np.float64)
    s = np.logaddexp(0.0, x)
    ids = np.argsort(-s, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(s, ids, axis=-1)
    if norm_topk:
        w = w / w.sum(-1, keepdims=True)
    return ids, w, s / s.sum(-1, keepdims=True)


@pytest.mark.parametrize("k,norm_topk", [(2, True), (3, False)])
def test_new_row_reaches_config_reference_and_docs(probe_row, k, norm_topk):
    seed = _seed()
    cfg = mp.MoEConfig(d_model=4,
                       d_ff=4,
                       num_experts=8,
                       top_k=k,
                       score_func=PROBE,
                       norm_topk=norm_topk)
    logits = 3.0 * jax.random.normal(jax.random.key(seed), (33, 8), jnp.float32)
    ids64, w64, p64 = _softplus_routing64(logits, k, norm_topk)
    tag = f"seed={seed}"
    r = routing.route_logits(logits, cfg, backend="xla")  # the op (its reference)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids64, err_msg=tag)
    assert rel_err(r.weights, w64) <= 1e-6 and rel_err(r.probs, p64) <= 1e-6, tag
    p_ref, ids_ref, w_ref = ref.router_for(logits, cfg, None)  # the tests' float64 reference
    np.testing.assert_array_equal(ids_ref, ids64, err_msg=tag)
    np.testing.assert_allclose(w_ref, w64, rtol=1e-12, err_msg=tag)
    np.testing.assert_allclose(p_ref, p64, rtol=1e-12, err_msg=tag)
    page = (ROOT / "docs/config.md").read_text()
    assert f"`'{PROBE}'`" not in page
    assert f"| `'{PROBE}'` | `True` | top-k of `softplus(logits) + b` |" in config.render_docs(page)
    assert PROBE in str(
        pytest.raises(ValueError, mp.MoEConfig, d_model=4, d_ff=4, num_experts=8,
                      score_func="nope").value)


def test_row_without_a_kernel_mode_runs_the_reference_on_the_cuda_backend(probe_row, monkeypatch):
    """No kernel mode: route(backend='cuda') warns, naming the score function, and runs the
    reference (the fused kernel is never asked for a mode it does not have)."""
    monkeypatch.setattr(backend, "op_backend", lambda b, op: "cuda")
    backend.reset_warnings()  # warn_once's memory, fresh for this test
    logits = jax.random.normal(jax.random.key(_seed()), (5, 8))
    with pytest.warns(UserWarning, match=f"score_func='{PROBE}' has no mode"):
        got = router.route(logits, None, backend="cuda", score_func=PROBE, top_k=2)
    want = router.router_reference(logits, None, score_func=PROBE, top_k=2)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("score_func,pre_softmax,field", [("nope", True, "score_func"),
                                                          ("relu", False, "score_func"),
                                                          ("sigmoid", False, "pre_softmax")])
def test_an_unknown_choice_raises_everywhere(score_func, pre_softmax, field):
    logits = jnp.ones((3, 8))
    static = dict(score_func=score_func, pre_softmax=pre_softmax, top_k=2)
    calls = {
        "MoEConfig":
        lambda: mp.MoEConfig(d_model=4, d_ff=4, num_experts=8, **static),
        "routing_table.resolve":
        lambda: routing_table.resolve(score_func, pre_softmax),
        "ops.route":
        lambda: router.route(logits, None, backend="xla", **static),
        "router_reference":
        lambda: router.router_reference(logits, None, **static),
        "router_cuda":
        lambda: router.router_cuda(logits, jnp.zeros(8), **static),
        "kernel_reference.router":
        lambda: ref.router(np.ones((3, 8)), **static),
        "kernel_reference.weights_for_ids":
        lambda: ref.weights_for_ids(
            logits, jnp.zeros((3, 2), jnp.int32), score_func=score_func, pre_softmax=pre_softmax),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{field}={static[field]!r} is invalid"):
            call()
            pytest.fail(f"{where} accepted {static}")


def test_softmax_topk_is_top_k_then_softmax():
    """The alias people search for: a config with it is the (softmax, pre_softmax=False) config,
    and the op routes with it bit for bit as with those fields."""
    a = mp.MoEConfig(d_model=4, d_ff=4, num_experts=8, score_func="softmax_topk")
    b = mp.MoEConfig(d_model=4, d_ff=4, num_experts=8, pre_softmax=False)
    assert a == b and (a.score_func, a.pre_softmax) == ("softmax", False)
    assert dataclasses.replace(a, top_k=3).pre_softmax is False
    logits = jax.random.normal(jax.random.key(_seed()), (17, 8))
    got = router.route(logits, None, backend="xla", score_func="softmax_topk", top_k=3)
    want = router.route(logits,
                        None,
                        backend="xla",
                        score_func="softmax",
                        pre_softmax=False,
                        top_k=3)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(got[1]), ids)


def test_kernel_modes_are_the_kernels_score_modes():
    """Each row's kernel_mode is one of the fused kernel's ScoreMode values, no two rows share
    one, and every ScoreMode has its row."""
    src = (ROOT / "kernels/router_kernels.cuh").read_text()
    enum = re.search(r"enum ScoreMode : int \{([^}]*)\}", src).group(1)
    modes = {int(v) for v in re.findall(r"=\s*(\d+)", enum)}
    rows = [c.kernel_mode for c in routing_table.CHOICES.values() if c.kernel_mode is not None]
    assert len(rows) == len(set(rows)) and set(rows) == modes, (rows, modes)


def test_config_md_generated_tables_are_in_step():
    page = (ROOT / "docs/config.md").read_text()
    assert config.render_docs(page) == page, (
        "docs/config.md is out of date: run `python -m moe_praxis.config --write`")


def test_enumerations_have_one_home():
    """MoEConfig's lists of valid names that the ops also check are the ops' own objects."""
    assert config.KERNEL_BACKENDS is backend.BACKENDS
    assert config.ROUTER_PRECISIONS is routing_table.ROUTER_PRECISIONS is router.ROUTER_PRECISIONS
    assert config.ACTIVATIONS is SWIGLU_ACTIVATIONS
    assert not hasattr(config, "SCORE_FUNCS") and not hasattr(router, "SCORE_FUNCS")
