"""moe_praxis.update_expert_bias (DeepSeek-V3's auxiliary-loss-free balancing rule) against a
NumPy float64 reference, and MoEConfig.expert_bias_update_rate's validation.

The rule moves each bias by exactly +-rate or 0, so on counts whose mean is exact in float32
(integer counts below 2^24) the float32 result equals the reference to float32 rounding of
b + rate: compared at 1 ulp (rtol 2^-23 of the magnitude, atol 1e-7 for values near 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import moe_praxis as mp
from tests.testutil import seed as _seed


def reference_update(bias, load, rate):
    """b + rate * sign(mean_load - load), in float64; np.sign(0) = 0."""
    load = np.asarray(load, np.float64)
    return np.asarray(bias, np.float64) + rate * np.sign(load.sum() / load.size - load)


def _check(bias, load, rate):
    got = mp.update_expert_bias(bias, load, rate)
    assert got.dtype == jnp.float32 and got.shape == np.shape(bias)
    want = reference_update(bias, load, rate)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2.0**-23, atol=1e-7)
    return np.asarray(got)


def test_recorded_counts_of_a_skewed_router():
    """Counts recorded from moe_block with one expert made attractive: its bias falls by
    rate, the underloaded experts' rise by rate."""
    seed = _seed()
    cfg = mp.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, use_expert_bias=True)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = mp.init_moe_params(k1, cfg)
    params["router"] = params["router"].at[:, 3].add(2.0)
    params["expert_bias"] = 0.1 * jax.random.normal(k3, (8, ))
    x = jax.random.normal(k2, (4, 32, 8)) + 1.0
    counts = np.asarray(mp.moe_block(params, x, cfg).tokens_per_expert)
    # every token's first choice: expert 3 holds about half the copies, far above the mean
    # (another expert may tie it as everyone's second choice, so no argmax)
    assert counts.sum() == 4 * 32 * 2, (seed, counts)
    assert counts[3] > 2 * counts.sum() / 8, (seed, counts)
    got = _check(params["expert_bias"], counts, 0.001)
    assert got[3] < float(params["expert_bias"][3]), (seed, counts)


def test_ties_sign_zero_and_all_zero_counts():
    bias = np.array([0.5, -0.25, 0.0, 1.0], np.float32)
    # mean 4: experts 1 and 3 are exactly at the mean (sign 0: unchanged)
    got = _check(bias, np.array([7, 4, 1, 4], np.int32), 0.01)
    assert got[1] == bias[1] and got[3] == bias[3]
    assert got[0] < bias[0] and got[2] > bias[2]
    # a perfectly balanced load and an all-zero one (nothing routed) change nothing
    np.testing.assert_array_equal(mp.update_expert_bias(bias, np.full(4, 9, np.int32), 0.1), bias)
    np.testing.assert_array_equal(mp.update_expert_bias(bias, np.zeros(4, np.int32), 0.1), bias)
    # mean 8/3 is not an integer: no tie; counts in float
    _check(bias[:3], np.array([3.0, 3.0, 2.0]), 0.5)
    # rate 0 (the default MoEConfig.expert_bias_update_rate) changes nothing
    np.testing.assert_array_equal(mp.update_expert_bias(bias, np.array([9, 0, 0, 0]), 0.0), bias)


def test_random_counts_and_a_bf16_bias_jitted():
    seed = _seed()
    rng = np.random.default_rng(seed)
    e = 64
    load = rng.integers(0, 5, e).astype(np.int32)
    load[-1] += (-load.sum()) % e  # an integer mean, which many small counts tie with
    assert (load == load.sum() // e).any(), (seed, load)
    bias = rng.normal(size=e).astype(np.float32)
    got = jax.jit(mp.update_expert_bias)(jnp.asarray(bias, jnp.bfloat16), load, 0.001)
    want = reference_update(np.asarray(jnp.asarray(bias, jnp.bfloat16), np.float64), load, 0.001)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2.0**-23, atol=1e-7, err_msg=str(seed))
    _check(bias, load, 0.25)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"shapes \(4,\) and \(3,\)"):
        mp.update_expert_bias(np.zeros(4), np.zeros(3), 0.1)
    with pytest.raises(ValueError, match=r"rate=-0.1 is invalid: must be a finite number >= 0"):
        mp.update_expert_bias(np.zeros(4), np.zeros(4), -0.1)
    with pytest.raises(ValueError, match=r"rate=nan is invalid"):
        mp.update_expert_bias(np.zeros(4), np.zeros(4), float("nan"))
    with pytest.raises(ValueError, match=r"rate must be a scalar"):
        mp.update_expert_bias(np.zeros(4), np.zeros(4), np.ones(4))


@pytest.mark.parametrize("kw,match", [
    (dict(expert_bias_update_rate=0.001), r"expert_bias_update_rate=0.001 is invalid: needs "
     r"use_expert_bias=True"),
    (dict(expert_bias_update_rate=-1e-3, use_expert_bias=True),
     r"expert_bias_update_rate=-0.001 is invalid: must be a finite float >= 0"),
    (dict(expert_bias_update_rate=float("inf"),
          use_expert_bias=True), r"expert_bias_update_rate=inf is invalid"),
])
def test_bad_update_rates_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, **kw)


def test_update_rate_field():
    assert mp.MoEConfig(d_model=8, d_ff=8, num_experts=4).expert_bias_update_rate == 0.0
    cfg = mp.MoEConfig(d_model=8,
                       d_ff=8,
                       num_experts=4,
                       use_expert_bias=True,
                       expert_bias_update_rate=1e-3)
    assert cfg.expert_bias_update_rate == 1e-3


def test_an_optax_step_over_trainable_mask_leaves_the_bias_to_update_expert_bias():
    """The README's training step: AdamW under optax.multi_transform over mp.trainable_mask
    leaves expert_bias bitwise as it was (a plain AdamW over the same dict decays it), the
    weights move, and update_expert_bias alone moves the bias (by the float64 reference)."""
    config = mp.MoEConfig(d_model=16,
                          d_ff=32,
                          num_experts=8,
                          top_k=2,
                          score_func="sigmoid",
                          use_expert_bias=True,
                          expert_bias_update_rate=1e-3)
    k0, k1, k2 = jax.random.split(jax.random.key(_seed()), 3)
    params = mp.init_moe_params(k0, config)
    params["expert_bias"] = jax.random.normal(k1, (8, ), jnp.float32)  # as after some updates
    assert mp.trainable_mask(params) == {k: k != "expert_bias" for k in params}
    x = jax.random.normal(k2, (64, config.d_model), jnp.float32)

    def loss_fn(p):
        out = mp.moe_block(p, x, config)
        return jnp.mean((out.y - x)**2) + out.aux_loss, out.tokens_per_expert

    (_, load), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)

    def step(tx):
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    plain = step(optax.adamw(1e-2, weight_decay=0.1))
    assert not np.array_equal(plain["expert_bias"], params["expert_bias"])  # what the mask avoids
    masked = step(
        optax.multi_transform(
            {
                True: optax.adamw(1e-2, weight_decay=0.1),
                False: optax.set_to_zero()
            }, mp.trainable_mask(params)))
    np.testing.assert_array_equal(masked["expert_bias"], params["expert_bias"])
    for name in params:
        if name != "expert_bias":
            assert not np.array_equal(masked[name], params[name]), name
    new = _check(masked["expert_bias"], load, config.expert_bias_update_rate)
    assert not np.array_equal(new, params["expert_bias"])
