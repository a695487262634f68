"""MoEFeedForward's statistics (summaries, aux and z losses, loads and drops) against float64
numpy formulas written out here (1e-5 relative), padded tokens counted nowhere."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from tests.praxis_layer_util import (B, DOCS, E, L, M, _init_layer, _inputs, _moe_tpl, _run_layer)

# ----------------------------------------------------------------------------- statistics


def _reference_stats(x, router, pad, *, k, aux_coeff, z_coeff):
    """float64 numpy: GShard aux loss, z-loss, load, entropy over valid tokens."""
    x2 = np.asarray(x, np.float64).reshape(-1, M)
    valid = np.asarray(pad).reshape(-1) < 0.5
    logits = x2 @ np.asarray(router, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    pv, idv = p[valid], ids[valid]
    n = valid.sum()
    counts = np.array([(idv == e).sum() for e in range(E)], np.float64)
    f1 = np.array([(idv[:, 0] == e).sum() for e in range(E)], np.float64)
    aux = aux_coeff * E / n**2 * np.sum(pv.sum(0) * f1)
    lse = np.log(np.exp(logits[valid]).sum(-1))
    return dict(aux=aux,
                z=z_coeff * np.mean(lse**2),
                load=counts / (n * k),
                entropy=np.mean(-(pv * np.log(pv)).sum(-1)))


@pytest.mark.parametrize("gating_func", ["dense_top2", "topk"])
def test_summaries_and_aux_losses_skip_padded_tokens(gating_func):
    k = 2 if gating_func == "dense_top2" else 3
    tpl = _moe_tpl(gating_func=gating_func,
                   num_experts_per_token=k,
                   norm_policy="post",
                   moe_load_balance_loss_weight=0.3,
                   router_z_loss_weight=0.02)
    x, pad = _inputs(11, pad_from=3)
    variables = _init_layer(tpl, x, pad, seed=12)
    # Padded tokens get huge inputs: they must not move any statistic.
    x = jnp.where(pad[..., None] > 0, 50.0 * x, x)
    _, summ, aux = _run_layer(tpl, variables, x, pad)
    ref = _reference_stats(x, variables["params"]["router"], pad, k=k, aux_coeff=0.3, z_coeff=0.02)
    np.testing.assert_allclose(aux["aux_moe_load_balance_loss"].value, ref["aux"], rtol=1e-5)
    np.testing.assert_allclose(aux["aux_moe_z_loss"].value, ref["z"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_aux_loss_scalar"], ref["aux"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_z_loss_scalar"], ref["z"], rtol=1e-5)
    np.testing.assert_allclose(summ["moe_router_entropy_scalar"], ref["entropy"], rtol=1e-5)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    np.testing.assert_allclose(load, ref["load"], rtol=1e-6)
    assert float(summ["moe_dropped_token_fraction_scalar"]) == 0.0
    # docs/praxis.md lists exactly the summaries the layer writes.
    documented = set(re.findall(r"^\| `(moe_[a-z_{}]+)` \| [a-z]", DOCS.read_text(), flags=re.M))
    written = {re.sub(r"_\d+$", "_{e}", k[:-len("_scalar")]) for k in summ}
    assert written == documented


def test_gshard_group_statistics_are_the_groups_means():
    """'top2' with num_groups=2: the aux loss, z-loss and router entropy are the means of the
    two groups' values (float64 references per group), the loads count both groups."""
    tpl = _moe_tpl(gating_func="top2",
                   num_groups=2,
                   unadjusted_expert_capacity_factor=float(E),
                   norm_policy="post",
                   moe_load_balance_loss_weight=0.3,
                   router_z_loss_weight=0.02)
    x, pad = _inputs(25)
    variables = _init_layer(tpl, x, pad, seed=26)
    _, summ, aux = _run_layer(tpl, variables, x, pad)
    x2, p2 = np.asarray(x).reshape(-1, M), np.asarray(pad).reshape(-1)
    half = x2.shape[0] // 2
    refs = [
        _reference_stats(x2[g * half:(g + 1) * half],
                         variables["params"]["router"],
                         p2[g * half:(g + 1) * half],
                         k=2,
                         aux_coeff=0.3,
                         z_coeff=0.02) for g in range(2)
    ]
    mean = lambda key: np.mean([r[key] for r in refs], axis=0)
    np.testing.assert_allclose(aux["aux_moe_load_balance_loss"].value, mean("aux"), rtol=1e-5)
    np.testing.assert_allclose(summ["moe_z_loss_scalar"], mean("z"), rtol=1e-5)
    np.testing.assert_allclose(summ["moe_router_entropy_scalar"], mean("entropy"), rtol=1e-5)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    np.testing.assert_allclose(load, mean("load"), rtol=1e-6)  # equal groups: mean = pooled


def test_padded_tokens_route_nowhere_even_with_capacity():
    # Padding first in token order, tight capacity: padded tokens would take the capacity
    # of the valid ones if they were routed.
    tpl = _moe_tpl(gating_func="top2",
                   unadjusted_expert_capacity_factor=1.0,
                   add_skip_connection=False)
    x, _ = _inputs(13)
    pad = jnp.zeros((B, L)).at[0, :5].set(1.0)
    variables = _init_layer(tpl, x, pad, seed=14)
    ys = [
        _run_layer(tpl, variables, jnp.where(pad[..., None] > 0, s * x, x), pad)[0]
        for s in (1.0, -30.0)
    ]
    np.testing.assert_array_equal(np.asarray(ys[0])[np.asarray(pad) > 0], 0.0)
    np.testing.assert_allclose(ys[0], ys[1], rtol=0, atol=1e-6)
    _, summ, _ = _run_layer(tpl, variables, x, pad)
    assert float(summ["moe_dropped_token_fraction_scalar"]) > 0  # the capacity binds


def test_skewed_routing_drops_and_loads():
    # Every token's first choice is expert 2 and its second expert 0 (norm_policy='post':
    # the router sees the raw, positive inputs): loads follow, the capacity drops half.
    tpl = _moe_tpl(gating_func="top2", unadjusted_expert_capacity_factor=2.0, norm_policy="post")
    x, pad = _inputs(15)
    x = jnp.abs(x) + 0.1
    variables = _init_layer(tpl, x, pad, seed=16)
    router = np.zeros((M, E), np.float32)
    router[:, 2], router[:, 0] = 1.0, 0.5
    params = dict(variables["params"], router=jnp.asarray(router))
    _, summ, _ = _run_layer(tpl, {"params": params}, x, pad)
    load = [float(summ[f"moe_expert_load_{e}_scalar"]) for e in range(E)]
    assert load == [0.5, 0.0, 0.5, 0.0]
    # T = 32 tokens, capacity round4(int(32 * 2 / 4)) = 16 per expert: 32 of 64 copies kept.
    np.testing.assert_allclose(float(summ["moe_dropped_token_fraction_scalar"]), 0.5)


def test_all_tokens_padded():
    tpl = _moe_tpl(gating_func="top2", router_z_loss_weight=0.1)
    x, _ = _inputs(18)
    pad = jnp.ones((B, L))
    variables = _init_layer(tpl, x, pad)
    y, summ, aux = _run_layer(tpl, variables, x, pad)
    np.testing.assert_array_equal(y, x)  # the MoE branch adds exactly zero
    assert float(aux["aux_moe_load_balance_loss"].value) == 0.0
    assert float(aux["aux_moe_z_loss"].value) == 0.0
    assert all(float(summ[f"moe_expert_load_{e}_scalar"]) == 0.0 for e in range(E))
    assert all(np.isfinite(float(v)) for v in summ.values())
