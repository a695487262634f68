"""The train step's FP8 expert weights made once per step (moe_praxis.praxis.fp8_params,
experiments.train.steps): through MoEFeedForward (a Praxis TransformerLm of TinyFp8's layers, plain
and repeated), bitwise the loss and gradients of each layer quantizing its own weights, and
the weights quantized once per step, never inside the layers."""

import warnings

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import moe_praxis  # noqa: F401  (Praxis shims before praxis is imported)
from configs import experiments
from experiments.train import steps
from moe_praxis.ops.fp8 import recipe as fp8, weights as fp8_weights
from moe_praxis.praxis import fp8_params
from praxis import base_layer, pax_fiddle, py_utils
from tests.testutil import seed as _seed


def _setup(repeat: bool, seed: int):

    class Fp8Lm(experiments.TinyFp8):
        REPEAT = repeat
        VOCAB_SIZE = 256  # the bytes tokenizer's, as the runner sets it
        NUM_LAYERS = 2
        SEQ_LEN = 16

    cfg = Fp8Lm().model()
    model = pax_fiddle.build(cfg)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 256, (4, 16)), jnp.int32)
    labels = py_utils.NestedMap(class_ids=jnp.asarray(rng.integers(0, 256, (4, 16)), jnp.int32),
                                class_weights=jnp.ones((4, 16), jnp.float32))
    paddings = jnp.zeros((4, 16), jnp.float32)
    key = jax.random.key(seed)
    variables = jax.jit(lambda k: model.init(
        {
            base_layer.PARAMS: k,
            base_layer.RANDOM: k
        }, ids, paddings, labels=labels))(key)

    def loss(params, tree):
        p = fp8_params.merge(params, tree) if tree else params
        with base_layer.JaxContext.new_context(hparams=base_layer.JaxContext.HParams(
                do_eval=False)):
            out, _ = model.apply({
                **variables, base_layer.PARAMS: p
            },
                                 ids,
                                 paddings,
                                 labels=labels,
                                 rngs={base_layer.RANDOM: key},
                                 mutable=steps.MUTABLE)
        return out.total_loss

    return cfg, variables[base_layer.PARAMS], loss


def test_step_fp8_weights_once_bitwise_equals_per_layer_quantization(monkeypatch):
    """Repeated (scanned) layers: the form made for the stacked weights, sliced per layer by
    the scan like the weights (unstacked layers take the same merge one level up)."""
    repeat = True
    seed = _seed()
    cfg, params, loss = _setup(repeat, seed)
    dtype, backend, _ = steps.fp8_layers(cfg)
    assert jnp.dtype(dtype) == jnp.bfloat16 and steps.fp8_layers(
        experiments.TinyBf16().model()) is None
    made, inside = [], []
    real_q, real_b = fp8_weights.quantize, fp8.quantize_blocks
    monkeypatch.setattr(fp8_weights, "quantize", lambda *a, **k: made.append(1) or real_q(*a, **k))
    monkeypatch.setattr(fp8, "quantize_blocks", lambda *a, **k: inside.append(1) or real_b(*a, **k))

    def once(p):
        tree = fp8_params.fp8_weights_tree(p, dtype)
        return jax.value_and_grad(loss)(p, tree)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the FP8 emulation's notice
        a = jax.jit(once)(params)
        # 2 MoE layers x (wi_gate, wi_up, wo); vmapped over the stack when repeated
        assert len(made) == (3 if repeat else 6) and inside == [], (made, inside)
        b = jax.jit(jax.value_and_grad(lambda p: loss(p, None)))(params)
    assert inside, "the per-layer path quantized nothing"
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 3
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x, np.float32),
                                      np.asarray(y, np.float32),
                                      err_msg=f"seed={seed}")
    wo = [g for path, g in jax.tree_util.tree_flatten_with_path(a[1])[0] if "wo" in str(path[-1])]
    assert wo and all(float(jnp.max(jnp.abs(g))) > 0 for g in wo)
