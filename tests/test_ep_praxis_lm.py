"""Expert parallelism in a Praxis model: a training step of a small TransformerLm whose MoE
layer is MoEFeedForward with mesh_resources gives the same loss (before and after one Adam
update) on dp8 and on dp2 x fsdp2 x ep2 (the 8 CPU devices of tests/conftest.py), for dense and
GShard capacity gating. Tolerance: 1e-5 relative in float32 (only summation order differs).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import moe_praxis as mp  # before praxis: applies the Praxis compat shims

from praxis import base_layer, pax_fiddle, py_utils
from praxis.layers import transformer_models, transformers

from tests.ep_util import D_MODEL, RTOL, _fast_jit, make_mesh
from tests.testutil import seed as _seed


def _praxis_lm(resources, gating_func):
    """A small TransformerLm (2 layers, the second MoE with our layer) using `resources`."""
    moe = pax_fiddle.Config(mp.MoEFeedForward, mesh_resources=resources, router_z_loss_weight=1e-3)
    st = pax_fiddle.Config(transformers.StackedTransformer,
                           num_layers=2,
                           moe_layers=[1],
                           model_dims=D_MODEL,
                           hidden_dims=24,
                           num_heads=2,
                           num_experts=8,
                           num_groups=1,
                           gating_func=gating_func,
                           moe_layer_tpl=moe)
    tpl = pax_fiddle.Config(transformer_models.TransformerLm,
                            name="lm",
                            model_dims=D_MODEL,
                            vocab_size=32,
                            stacked_transformer_tpl=st)
    return base_layer.instantiate(tpl)


@pytest.mark.slow
@pytest.mark.parametrize("gating_func", ["dense_top2", "top2"])
def test_praxis_lm_train_step_same_loss_on_dp8_and_dp2xfsdp2xep2(gating_func):
    """A training step of a small Praxis LM (MoEFeedForward with mesh_resources, under
    jax.set_mesh): the loss before and after one Adam update (so the gradients too) is the
    same on dp8 and on dp2 x fsdp2 x ep2. 'top2' is GShard's capacity gating, which under EP
    applies one capacity to the global batch, as on one device."""
    seed = _seed()
    b, l, v = 8, 8, 32  # 64 tokens: 8 per token shard
    k1, k2 = jax.random.split(jax.random.key(seed))
    inp = jax.random.randint(k1, (b, l), 0, v)
    tgt = jax.random.randint(k2, (b, l), 0, v)
    pad = jnp.zeros((b, l), jnp.float32).at[-1, l - 3:].set(1.0)
    labels = py_utils.NestedMap(class_ids=tgt, class_weights=1.0 - pad)

    def run(mesh_name):
        mesh, res = make_mesh(mesh_name)
        lm = _praxis_lm(res, gating_func)
        with base_layer.JaxContext.new_context():
            params = _fast_jit(lambda k: lm.init(k, inp, pad, labels=labels))(
                jax.random.key(seed + 1))["params"]
        opt = optax.adam(1e-2)

        def loss_fn(p):
            with base_layer.JaxContext.new_context():
                out, _ = lm.apply({"params": p},
                                  inp,
                                  pad,
                                  labels=labels,
                                  mutable=[base_layer.AUX_LOSS, base_layer.SUMMARIES])
            return out.total_loss

        def two_steps(p):
            loss0, g = jax.value_and_grad(loss_fn)(p)
            updates, _ = opt.update(g, opt.init(p), p)
            return loss0, loss_fn(optax.apply_updates(p, updates))

        with jax.set_mesh(mesh):
            return _fast_jit(two_steps)(params)

    ref = run("dp8")
    got = run("dp2xfsdp2xep2")
    for a, r in zip(got, ref):
        assert abs(float(a) - float(r)) <= RTOL * abs(float(r)), (
            f"seed={seed} {gating_func}: {[float(g) for g in got]} vs {[float(g) for g in ref]}")
    assert abs(float(ref[1]) - float(ref[0])) > 1e-3  # the update changed the loss
