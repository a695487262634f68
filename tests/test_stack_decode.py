"""DenseFirstRepeated decodes: extend_step after a prefix fprop equals the full fprop.

TransformerLm's decoding protocol: a full-length fprop with `start_time_step=P` fills the
decode caches (DECODE_CACHE) of every attention layer, dense and repeated, and sets the time
step to P; each extend_step then computes position t from the cache of positions < t (the
token at t overwrites the cache at t with what the fprop put there). Its logits must equal the
fprop's at t: float32, 1e-5 relative (the same arithmetic, attention over a masked cache
instead of a causal mask). Dropless top-k routing, so a token's output does not depend on the
other tokens of the step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from configs import models
from moe_praxis.praxis.stack import DenseFirstRepeated
from praxis import base_layer
from praxis import pax_fiddle

from tests import decode_util

B, T, V, P = 2, 8, 32, 3


def _lm(first_k_dense):
    cfg = models.transformer_lm(vocab_size=V,
                                model_dims=16,
                                hidden_dims=32,
                                num_layers=3,
                                num_heads=2,
                                num_experts=4,
                                top_k=2,
                                repeat=True,
                                first_k_dense=first_k_dense)
    assert cfg.stacked_transformer_tpl.__fn_or_cls__ is DenseFirstRepeated
    return pax_fiddle.instantiate(cfg)


def _ctx(do_eval=True):
    return base_layer.JaxContext.new_context(hparams=base_layer.JaxContext.HParams(do_eval=do_eval))


@pytest.mark.parametrize("first_k_dense", [1, 2])
def test_extend_step_equals_fprop(first_k_dense):
    lm = _lm(first_k_dense)
    ids = jax.random.randint(jax.random.PRNGKey(first_k_dense), (B, T), 0, V)
    pad = jnp.zeros((B, T), jnp.float32)
    with _ctx():
        variables = lm.init(jax.random.PRNGKey(7), ids, pad)
    variables = {k: v for k, v in variables.items() if k != base_layer.DECODE_CACHE}
    assert "dense" in variables["params"]["transformer"]

    logits, cache = decode_util.prefill(lm, variables, ids, P)
    assert "dense" in cache["transformer"]  # the dense layers keep their own caches
    for t, got, cache in decode_util.extend_steps(lm, variables, cache, ids, P):
        want = np.asarray(logits[:, t])
        err = np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)
        assert err < 1e-5, (t, err)
        assert int(cache["time_step"]) == t + 1


def test_transform_decode_state_reaches_the_dense_layers():
    """A decode-state transform (here: zero every cached state) reaches the dense layers'
    attention caches as well as the repeats'."""
    lm = _lm(1)
    ids = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, V)
    pad = jnp.zeros((B, T), jnp.float32)
    with _ctx():
        variables = lm.init(jax.random.PRNGKey(0), ids, pad)
        variables = {k: v for k, v in variables.items() if k != base_layer.DECODE_CACHE}
        _, upd = lm.apply(variables, ids, pad, mutable=[base_layer.DECODE_CACHE])
    cache = upd[base_layer.DECODE_CACHE]

    def f(v):
        with _ctx():
            return lm.apply(v,
                            lambda x, batch_dim, time_dim: jnp.zeros_like(x),
                            method=lambda m, fn: m.transformer.transform_decode_state(fn),
                            mutable=[base_layer.DECODE_CACHE])[1][base_layer.DECODE_CACHE]

    new = f(dict(variables, **{base_layer.DECODE_CACHE: cache}))
    for part in ("dense", "repeat"):
        before = jax.tree.leaves(cache["transformer"][part])
        after = jax.tree.leaves(new["transformer"][part])
        assert before and any(np.abs(np.asarray(x)).max() > 0 for x in before), part
        assert all(np.abs(np.asarray(x)).max() == 0 for x in after), part
