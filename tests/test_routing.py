"""Router, aux losses and config validation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from moe_praxis import ops, router_stats, routing
from moe_praxis.ops.router import router_cuda
from tests import kernel_reference as ref
from tests.testutil import rel_err, router_config
from tests.testutil import seed as _seed

F32_TOL = 1e-6  # float32 against the float64 reference: rounding of exp, sums and divisions

# ------------------------------------------------------------------ aux loss (ops.aux_loss)


@pytest.mark.parametrize("t,e,k", [(13, 4, 1), (64, 8, 2), (37, 64, 8)])
def test_aux_loss_value_and_grad_match_formula(t, e, k):
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    probs = jax.nn.softmax(jax.random.normal(k1, (t, e)), -1)
    f = jax.random.randint(k2, (e, ), 0, t * k // e + 3)
    coeff = 0.37
    p64, f64 = np.asarray(probs, np.float64), np.asarray(f, np.float64)
    want = coeff * e / (k * t * t) * np.sum(p64.sum(0) * f64)
    got = ops.aux_loss(probs, f, top_k=k, coeff=coeff)
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6, err_msg=f"seed={seed}")
    g = jax.jit(jax.grad(lambda p: 2.5 * ops.aux_loss(p, f, top_k=k, coeff=coeff)))(probs)
    want_g = 2.5 * coeff * e / (k * t * t) * np.broadcast_to(f64, (t, e))
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-6, err_msg=f"seed={seed}")


def test_aux_loss_balanced_routing_equals_coeff():
    t, e, k = 64, 8, 2
    probs = jnp.full((t, e), 1.0 / e)
    f = jnp.full((e, ), t * k // e)
    np.testing.assert_allclose(float(ops.aux_loss(probs, f, top_k=k, coeff=0.01)), 0.01, rtol=1e-6)


def test_aux_loss_num_tokens_shards_sum_to_global():
    seed = _seed()
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(seed), (40, 8)), -1)
    f = jnp.arange(8) * 3
    full = ops.aux_loss(probs, f, top_k=2, coeff=0.1)
    parts = sum(
        ops.aux_loss(probs[i:i + 10], f, top_k=2, coeff=0.1, num_tokens=40)
        for i in range(0, 40, 10))
    np.testing.assert_allclose(float(parts), float(full), rtol=1e-6)


def test_aux_loss_backward_keeps_rank0_cotangent():
    import importlib

    al = importlib.import_module("moe_praxis.ops.aux_loss")

    probs = jnp.ones((4, 2)) / 2
    f = jnp.array([3, 5])
    # The backward rule rejects anything but a rank-0 cotangent.
    with pytest.raises(ValueError, match="rank 0"):
        al.aux_loss_bwd_reference(jnp.ones((1, )), probs, f, top_k=2, coeff=1.0)
    # And what autodiff hands it is rank 0: the custom_vjp backward sees shape ().
    seen = []
    orig = al.aux_loss_bwd_reference

    def spy(g, *a, **kw):
        seen.append(jnp.shape(g))
        return orig(g, *a, **kw)

    al.aux_loss_bwd_reference = spy
    try:
        jax.grad(lambda p: ops.aux_loss(p, f, top_k=2, coeff=1.0, backend="xla"))(probs)
    finally:
        al.aux_loss_bwd_reference = orig
    assert seen and all(s == () for s in seen), seen


def test_aux_loss_jit_grad_on_sharded_probs_lowers():
    mesh = jax.make_mesh((4, ), ("d", ),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Explicit, ))
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(_seed()), (32, 8)), -1)
    probs = jax.device_put(probs, NamedSharding(mesh, P("d", None)))
    f = jnp.arange(8)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(lambda p: ops.aux_loss(p, f, top_k=2, coeff=0.5)))(probs)
    want = 0.5 * 8 / (2 * 32 * 32) * np.broadcast_to(np.arange(8.0), (32, 8))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


def test_aux_loss_bad_shapes():
    with pytest.raises(ValueError, match=r"probs must be \[T, E\]"):
        ops.aux_loss(jnp.ones((4, )), jnp.ones((4, )), top_k=1, coeff=1.0)
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[E=3\]"):
        ops.aux_loss(jnp.ones((4, 3)), jnp.ones((4, )), top_k=1, coeff=1.0)


# ---------------------------------------------------------------------------------- router


def test_expert_bias_steers_selection_only():
    cfg = mp.MoEConfig(d_model=4,
                       d_ff=4,
                       num_experts=4,
                       top_k=1,
                       use_expert_bias=True,
                       norm_topk=False)
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    r = routing.route_logits(logits, cfg, bias)
    assert int(r.expert_ids[0, 0]) == 3  # the bias picked expert 3 ...
    np.testing.assert_allclose(float(r.weights[0, 0]),
                               float(jax.nn.softmax(logits)[0, 3]),
                               rtol=1e-6)  # ... but its weight is the unbiased score
    gb = jax.grad(lambda b: routing.route_logits(logits, cfg, b).weights.sum())(bias)
    assert float(jnp.abs(gb).max()) == 0.0


def test_group_limited_topk_keeps_best_groups():
    # 8 experts in 4 groups of 2; top_k=4 from group_topk=2 groups; group score = top-2 sum.
    cfg = mp.MoEConfig(d_model=4,
                       d_ff=4,
                       num_experts=8,
                       top_k=4,
                       num_expert_groups=4,
                       group_topk=2,
                       score_func="sigmoid")
    # Expert 0 alone is the best, but its group (0,1) sums lower than groups (2,3) and (6,7).
    logits = jnp.array([[4.0, -4.0, 2.0, 2.0, 0.0, 0.0, 1.9, 1.9]])
    r = routing.route_logits(logits, cfg)
    assert sorted(np.asarray(r.expert_ids[0]).tolist()) == [2, 3, 6, 7]


def test_ties_go_to_the_lower_index():
    cfg = mp.MoEConfig(d_model=4, d_ff=4, num_experts=6, top_k=3)
    r = routing.route_logits(jnp.zeros((2, 6)), cfg)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), [[0, 1, 2], [0, 1, 2]])


def test_post_softmax_weights_sum_to_one_and_scaling():
    cfg = mp.MoEConfig(d_model=4,
                       d_ff=4,
                       num_experts=8,
                       top_k=3,
                       pre_softmax=False,
                       routed_scaling_factor=2.0)
    logits = jax.random.normal(jax.random.key(_seed()), (5, 8))
    r = routing.route_logits(logits, cfg)
    np.testing.assert_allclose(np.asarray(r.weights.sum(-1)), 2.0, rtol=1e-6)
    want_ids = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(r.expert_ids), want_ids)


def test_router_is_float32_for_bf16_inputs():
    cfg = mp.MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2)
    x = jnp.ones((3, 4), jnp.bfloat16)
    r = routing.route(x, jnp.ones((4, 4), jnp.bfloat16), cfg)
    assert r.logits.dtype == r.probs.dtype == r.weights.dtype == jnp.float32


def test_router_precision_default_is_todays_float32_gemm_bit_for_bit():
    """The default router_precision ('auto': 'bf16x3' on a GPU) computes the logits on the CPU
    exactly as before the field existed: float32 inputs, jnp.dot at Precision.HIGHEST (and so
    the whole route)."""
    seed = _seed()
    kx, kw = jax.random.split(jax.random.key(seed))
    cfg = mp.MoEConfig(d_model=64, d_ff=8, num_experts=16, top_k=4)
    assert cfg.router_precision == "auto"
    x = jax.random.normal(kx, (256, 64), jnp.bfloat16)
    w = jax.random.normal(kw, (64, 16), jnp.float32) / 8
    today = jax.jit(lambda x, w: jnp.dot(
        x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))
    got = jax.jit(lambda x, w: routing.router_logits(x, w, cfg))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(today(x, w)), f"seed={seed}")


def _changed_choices(ids, ref_ids, e):
    """Share of the reference's (token, expert) choices that `ids` does not make."""
    a = np.zeros((ids.shape[0], e), bool)
    b = np.zeros_like(a)
    np.put_along_axis(a, np.asarray(ids), True, axis=1)
    np.put_along_axis(b, np.asarray(ref_ids), True, axis=1)
    return float(np.sum(b & ~a) / b.sum())


def test_router_precision_effect_on_logits_and_top_k_choices():
    """Lower router precisions at a Qwen3-MoE-like router (M=2048, E=128, k=8, bf16 x,
    init_moe_params' router), against float32 on the same fresh random inputs.

    Logits vs a float64 reference (||got - ref|| / ||ref||): float32 under 1e-5; 'tf32' rounds
    the router weights to 10 mantissa bits (a bf16 x is exact in TF32), measured near 2e-4,
    bounded to [2e-5, 1e-3]; 'bf16' also rounds them to 7 bits, measured near 2e-3, bounded to
    [3e-4, 1e-2]. Top-k choices that change (of T * k): 'tf32' measured 0.1-0.2%, bounded by
    0.5%; 'bf16' measured 0.4-0.6%, bounded by 1.5% (and above 0: it does change some).
    'bf16x3' (the GPU's default; its bf16 GEMMs run on the CPU too) keeps 16 mantissa bits of
    the router weights: logits measured near 3e-6, bounded by 2e-5; choices changed bounded by
    0.05%."""
    seed = _seed()
    t, m, e, k = 4096, 2048, 128, 8
    kx, kp = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (t, m), jnp.bfloat16)
    base = mp.MoEConfig(d_model=m, d_ff=8, num_experts=e, top_k=k, kernel_backend="xla")
    w = mp.init_moe_params(kp, base)["router"]
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = {}
    for prec in ("float32", "tf32", "bf16", "bf16x3"):
        cfg = dataclasses.replace(base, router_precision=prec)
        r = jax.jit(lambda x, w: routing.route(x, w, cfg))(x, w)
        assert r.logits.dtype == r.weights.dtype == jnp.float32
        err = np.linalg.norm(np.asarray(r.logits, np.float64) - ref) / np.linalg.norm(ref)
        got[prec] = (err, np.asarray(r.expert_ids))
    msg = f"seed={seed} " + str({
        p: (f"{v[0]:.2e}", _changed_choices(v[1], got['float32'][1], e))
        for p, v in got.items()
    })
    assert got["float32"][0] < 1e-5, msg
    assert 2e-5 < got["tf32"][0] < 1e-3, msg
    assert 3e-4 < got["bf16"][0] < 1e-2, msg
    assert _changed_choices(got["tf32"][1], got["float32"][1], e) < 0.005, msg
    assert 0 < _changed_choices(got["bf16"][1], got["float32"][1], e) < 0.015, msg
    assert got["bf16x3"][0] < 2e-5, msg
    assert _changed_choices(got["bf16x3"][1], got["float32"][1], e) < 0.0005, msg


def test_router_precision_reaches_the_block_and_its_gradients():
    """moe_block with router_precision='bf16' differs from float32 only by the router GEMM's
    rounding: where it leaves a token's top-k experts as they were, the token's output is
    float32's within bf16 tolerance (the loss over those tokens within 1e-2 relative);
    gradients finite, the router's gradient float32.

    A rounding that flips a near-tie in a token's top-k moves that token's output by a step,
    not by rounding (it happened to 1-3 of the 64 tokens in 17% of 8001 seeds, and moved the
    whole loss by up to 7.7%), so the loss is compared over the tokens whose experts agree,
    and the flips are counted: over those 8001 seeds the largest relative gap on the tokens
    that agree was 0.23%, 4.3x under the bound, and at most 3 tokens flipped."""
    seed = _seed()
    cfg = mp.MoEConfig(d_model=32, d_ff=16, num_experts=8, top_k=2, kernel_backend="xla")
    kp, kx = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(kp, cfg)
    x = jax.random.normal(kx, (64, 32), jnp.float32)

    def loss(params, cfg):
        return jnp.sum(mp.moe_block(params, x, cfg).y**2)

    lo = dataclasses.replace(cfg, router_precision="bf16")
    v32, g32 = jax.value_and_grad(loss)(params, cfg)
    v16, g16 = jax.value_and_grad(loss)(params, lo)
    ids32, ids16 = (np.sort(np.asarray(routing.route(x, params["router"], c).expert_ids), -1)
                    for c in (cfg, lo))
    same = np.all(ids32 == ids16, -1)
    per_token = [
        np.sum(np.asarray(mp.moe_block(params, x, c).y, np.float64)**2, -1) for c in (cfg, lo)
    ]
    a32, a16 = (float(p[same].sum()) for p in per_token)
    said = (f"seed={seed}: loss over the {same.sum()} tokens whose experts agree {a16} (bf16) "
            f"vs {a32}; whole loss {float(v16)} vs {float(v32)}")
    assert (~same).sum() <= 8, said  # a bf16 router flips near-ties only
    assert abs(a16 - a32) <= 1e-2 * abs(a32), said
    assert abs(float(v32) - per_token[0].sum()) <= 1e-4 * float(v32), said  # the same loss
    assert g16["router"].dtype == jnp.float32
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(g16))
    assert not np.array_equal(np.asarray(g16["router"]), np.asarray(g32["router"]))


def test_z_loss_formula():
    logits = jax.random.normal(jax.random.key(_seed()), (6, 5))
    valid = jnp.array([1, 1, 0, 1, 1, 1], bool)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    want = 0.3 * np.mean((lse**2)[np.asarray(valid)])
    np.testing.assert_allclose(float(router_stats.z_loss(logits, valid, 0.3)), want, rtol=1e-6)


# ---------------------------------------------------------------------------------- config

BAD = [
    (dict(top_k=9), "top_k=9 .*num_experts=8"),
    (dict(top_k=0), "top_k=0 .*positive int"),
    (dict(num_experts=0), "num_experts=0"),
    (dict(score_func="relu"), "score_func='relu'.*softmax"),
    (dict(score_func="sigmoid", pre_softmax=False), "pre_softmax=False"),
    (dict(num_expert_groups=3), "num_expert_groups=3 .*divide num_experts=8"),
    (dict(num_expert_groups=4, group_topk=3), "group_topk=3 .*divide top_k=2"),
    (dict(num_expert_groups=4, group_topk=5), "group_topk=5 .*num_expert_groups=4"),
    (dict(group_topk=2), "group_topk=2 .*num_expert_groups=1"),
    (dict(top_k=8, num_expert_groups=4, group_topk=2), "group_topk=2"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
    (dict(router_logit_cap=-1.0), "router_logit_cap=-1.0"),
    (dict(router_precision="fp16"), "router_precision='fp16'.*float32.*tf32.*bf16"),
    (dict(aux_loss_type="foo"), "aux_loss_type='foo'.*switch"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff=-1.0"),
    (dict(z_loss_coeff=float("nan")), "z_loss_coeff=nan"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 .*None \\(dropless\\)"),
    (dict(drop_policy="random"), "drop_policy='random'"),
    (dict(activation="tanh"), "activation='tanh'"),
    (dict(kernel_backend="triton"), "kernel_backend='triton'.*auto"),
    (dict(param_init_scale=0.0), "param_init_scale=0.0"),
]


@pytest.mark.parametrize("kw,pattern", BAD, ids=[b[1][:30] for b in BAD])
def test_config_rejects_bad_values_naming_them(kw, pattern):
    base = dict(d_model=8, d_ff=8, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="MoEConfig." + pattern.split("=")[0].split(" ")[0]) as e:
        mp.MoEConfig(**{**base, **kw})
    import re

    assert re.search(pattern, str(e.value)), str(e.value)


def test_config_defaults_are_mixtral_gshard_routing():
    c = mp.MoEConfig(d_model=8, d_ff=8, num_experts=8)
    assert (c.score_func, c.pre_softmax, c.norm_topk, c.gated, c.activation, c.capacity_factor,
            c.kernel_backend, c.use_cudnn_fusion) == ("softmax", True, True, True, "silu", None,
                                                      "auto", False)
    assert dataclasses.is_dataclass(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3


# ------------------------------------------- the CUDA router's argument path, on the CPU

ROUTER_CASES = [
    (37, 16, 4, "softmax", True, True, 4, 2, 1.0, False),
    (29, 64, 8, "sigmoid", True, True, 8, 4, 2.5, True),
    (23, 8, 2, "softmax", False, True, 1, 1, 1.0, True),
    (23, 8, 1, "softmax", True, True, 1, 1, 1.0, False),
]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_router_path_matches_numpy_reference(case):
    t, e, k, sf, pre, norm, g, gk, sc, use_bias = case
    cfg = router_config(e, k, sf, pre, norm, g, gk, sc, use_bias)
    s = _seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(s), 4)
    logits = jax.random.normal(k1, (t, e))
    bias = 0.1 * jax.random.normal(k2, (e, )) if use_bias else jnp.zeros((e, ))
    kern = functools.partial(router_cuda, **routing.router_args(cfg))
    probs, ids, w = jax.jit(kern)(logits, bias)
    p64, ids64, w64 = ref.router_for(logits, cfg, bias)
    np.testing.assert_array_equal(np.asarray(ids), ids64, err_msg=f"seed={s}")
    assert rel_err(probs, p64) <= F32_TOL and rel_err(w, w64) <= F32_TOL
    # gradient of the custom_vjp (reference backward branch) == autodiff of the reference
    dp, dw = jax.random.normal(k3, (t, e)), jax.random.normal(k4, (t, k))
    f1 = lambda l: jnp.sum(kern(l, bias)[0] * dp) + jnp.sum(kern(l, bias)[2] * dw)
    r_bias = bias if use_bias else None
    f2 = lambda l: jnp.sum(routing.route_logits_reference(l, cfg, r_bias).probs * dp) + jnp.sum(
        routing.route_logits_reference(l, cfg, r_bias).weights * dw)
    assert rel_err(jax.grad(f1)(logits), jax.grad(f2)(logits)) <= F32_TOL
