"""Helpers of the Praxis layer tests (test_praxis_layer*.py, test_praxis_converter.py): tiny
shapes, fast XLA:CPU compiles, templates, inputs, meshes and the LM built around the layer."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from moe_praxis import MeshResources, MoEFeedForward

from praxis import base_layer, pax_fiddle, py_utils
from praxis.layers import transformer_models, transformers

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


def _praxis_moe_tpl(**kw):
    return pax_fiddle.Config(transformers.TransformerFeedForwardMoe, **kw)


def _with_defaults(kw):
    out = dict(name="moe", input_dims=M, hidden_dims=H, num_experts=E, num_groups=1)
    out.update(kw)
    return out


def _mesh_2x2():
    return jax.make_mesh((2, 2), ("data", "mdl"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 2)


_EP_AXES = ("data", "fsdp", "expert")  # DP2 x FSDP2 x EP2 on the 8 CPU devices


def _ep_tpl(emh="unset", ehm="unset", me="unset", shape=(2, 2, 2), **kw):
    """A layer with mesh_resources AND its own mesh (ici_mesh_shape / mesh_axis_names), 8
    experts; letters not given stay unset (None)."""
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
