"""Remat policies (configs.models.set_remat, moe_praxis.praxis.remat): a policy changes what the
backward recomputes, never the math. A policy's loss and gradients equal the model's without
remat to 1e-5 (float32: the recomputed forward is the same arithmetic, XLA may fuse it
differently); the policies that recompute more run more matrix products in the step's jaxpr."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp  # (also applies the Praxis compat shims)
from configs import models, registry
from praxis import base_layer, pax_fiddle
from praxis.layers import checkpoint_policy
from moe_praxis.ops import backend as backend_mod
from moe_praxis.praxis.remat import POLICIES
from praxis.layers import transformers
from tests.praxis_layer_util import _FAST_COMPILE

B, T, V = 2, 8, 32


def _cfg(remat, repeat=True):
    return models.transformer_lm(vocab_size=V,
                                 model_dims=16,
                                 hidden_dims=32,
                                 num_layers=2,
                                 num_heads=4,
                                 num_kv_heads=2,
                                 num_experts=4,
                                 top_k=2,
                                 repeat=repeat,
                                 remat=remat)


def test_set_remat_round_trips_and_keeps_the_presets_default():
    # mixtral_moe_gpu's policy was chosen by benchmarks.e2e on an H100 (docs/performance.md);
    # qwen3_moe_gpu keeps full remat until it is measured on an H200
    presets = {
        "mixtral_moe_gpu": "save_dot_except_mlp",
        "mixtral_moe_gpu_fp8": "save_dot_except_mlp",
        "qwen3_moe_gpu": "full",
        "tiny": "none",
        "small_gpu": "none"
    }
    for name, want in presets.items():
        cfg = registry.get_experiment(name)().experiment_config()
        assert models.remat_policy(cfg.model) == want, name
        layer = models.stack_block(cfg.model).transformer_layer_params_tpl
        assert layer.__fn_or_cls__ is transformers.Transformer  # today's layer, untouched
    for repeat in (True, False):
        cfg = _cfg(True, repeat)
        assert models.remat_policy(cfg) == "full"
        for policy in models.REMAT_POLICIES:
            models.set_remat(cfg, policy)
            assert models.remat_policy(cfg) == policy, (repeat, policy)
    assert models.remat_policy(_cfg(False, repeat=False)) == "none"
    with pytest.raises(ValueError,
                       match=r"remat='most' is invalid; valid: True, False, full, none"):
        models.set_remat(cfg, "most")


def test_named_policies_resolve_through_praxis():
    for name, (_, policy) in POLICIES.items():
        assert checkpoint_policy.custom_policy(name) is policy
    ckpt = transformers.AutodiffCheckpointType
    assert checkpoint_policy.custom_policy(
        ckpt.SAVE_EVERYTHING) is (jax.checkpoint_policies.everything_saveable)


def _loss_and_grads(cfg, ids, labels, numbers=True):
    """((loss, grads) or None, the dot_generals in the jaxpr of the step's gradient)."""
    lm = pax_fiddle.instantiate(cfg)
    pad = jnp.zeros((B, T), jnp.float32)
    lab = base_layer.NestedMap(class_ids=labels, class_weights=jnp.ones((B, T), jnp.float32))
    with base_layer.JaxContext.new_context():
        variables = lm.init(jax.random.PRNGKey(0), ids, pad, labels=lab)

    def loss(params):
        with base_layer.JaxContext.new_context():
            out = lm.apply({**variables, "params": params}, ids, pad, labels=lab)
        return out.total_loss

    f = jax.value_and_grad(loss)
    dots = str(jax.make_jaxpr(f)(variables["params"])).count("dot_general")
    if not numbers:
        return None, dots
    return jax.jit(f).lower(variables["params"]).compile(_FAST_COMPILE)(variables["params"]), dots


@pytest.mark.slow
def test_policies_change_no_number(repeat=True):
    """On the repeated (scanned) stack, as the GPU presets build it."""
    rng = np.random.default_rng()
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    (want, want_g), dots_none = _loss_and_grads(_cfg("none", repeat), ids, labels)
    dots = {}
    for policy in models.REMAT_POLICIES:
        numbers = policy in ("full", "save_moe_and_attention_out")  # compiles cost: two of them
        got, dots[policy] = _loss_and_grads(_cfg(policy, repeat), ids, labels, numbers)
        if got is None:
            continue
        loss, grads = got
        assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want)), policy
        for (path, g), w in zip(
                jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(want_g)):
            err = float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
            assert err < 1e-5, (policy, jax.tree_util.keystr(path), err)
    # Recomputing (part of) the forward in the backward runs its products again; saving every
    # named GEMM output recomputes none of the attention's and MoE block's.
    assert dots["none"] == dots_none
    assert dots["full"] > dots_none and dots["save_moe_and_attention_out"] > dots_none, dots
    assert dots["save_dot_except_mlp"] > dots["save_attention_and_moe_gemms"], dots


# The expert GEMM kernels' FFI targets (the fused gate/up forward, the plain, dSwiGLU and FP8
# grouped GEMMs, forward and backward).
_GEMM_TARGET = re.compile(r"target_name=['\"]?(moe_grouped_gemm\w*)")


def _expert_gemms(cfg, policy):
    """The expert GEMM FFI calls in the jaxpr of the block's gradient under jax.checkpoint with
    `policy` (None: no remat), by target."""
    params = mp.init_moe_params(jax.random.PRNGKey(0), cfg)
    x = jax.random.normal(jax.random.PRNGKey(1), (64, cfg.d_model)).astype(jnp.bfloat16)

    def loss(p, x):
        return mp.moe_block(p, x, cfg).y.astype(jnp.float32).sum()

    f = loss if policy is None else jax.checkpoint(loss, policy=POLICIES[policy][1])
    return collections.Counter(_GEMM_TARGET.findall(str(jax.make_jaxpr(jax.grad(f))(params, x))))


@pytest.mark.parametrize("fusion", [
    dict(),
    dict(fuse_gate_up=True),
    dict(fuse_gate_up=True, fuse_swiglu_bwd=True),
    dict(fuse_swiglu_bwd=True),
    dict(fp8="blockwise", fp8_gemms="all"),
],
                         ids=["separate", "fused_gate_up", "fused_gate_up_down", "dswiglu", "fp8"])
def test_saving_the_moe_gemms_recomputes_no_expert_gemm_on_the_cuda_path(fusion, monkeypatch):
    """save_attention_and_moe_gemms: the backward runs exactly the expert GEMMs of the step
    without remat, for every fusion of the CUDA path (traced with the CUDA status forced on;
    nothing runs). The fused ops keep gate and up as custom_vjp residuals, named inside their
    forward rules, or the policy would rerun the fused forward to get them back.
    save_dot_except_mlp reruns the gate/up projections."""
    monkeypatch.setattr(backend_mod, "cuda_status", lambda op="": (True, "forced by the test"))
    cfg = mp.MoEConfig(d_model=128,
                       d_ff=256,
                       num_experts=8,
                       top_k=2,
                       kernel_backend="cuda",
                       **fusion)
    none = _expert_gemms(cfg, None)
    assert sum(none.values()) >= 4, none  # the forward's and the backward's GEMMs are counted
    assert _expert_gemms(cfg, "save_attention_and_moe_gemms") == none
    assert sum(_expert_gemms(cfg, "save_dot_except_mlp").values()) > sum(none.values())
