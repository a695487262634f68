"""Float64 NumPy references for the kernels' and the block's tests (not the ops code).

Written from the formulas in ops/swiglu.py, ops/permute.py and ops/aux_loss.py, loop by loop,
so that a shared bug in the JAX reference and a kernel shows. Routing is the one exception to
"not the ops code": the score functions' math is read from moe_praxis.ops.routing_table (the one
table of the router's choices), run in float64; the selection around it is written out here.
Every test that needs routing math uses router / weights_for_ids / probs_for from this module.
"""

import jax
import jax.numpy as jnp
import numpy as np

from moe_praxis.ops import routing_table

from tests.testutil import rel_err, seed, sum_err  # noqa: F401  (re-exported for the kernel tests)


def _topk_ids(v, k):
    # descending, ties to the lower index (stable sort of -v)
    return np.argsort(-v, kind="stable")[:k]


def _row_math(fn, *arrays):
    """A routing_table row's function on float64 arrays (jax with x64) -> NumPy float64."""
    with jax.enable_x64(True):
        return np.asarray(fn(*(jnp.asarray(np.asarray(a)) for a in arrays)))


def selection_scores(logits, *, score_func="softmax", pre_softmax=True, bias=None):
    """What top-k selects on, float64 [T, E]: the row's selection scores + bias."""
    choice = routing_table.resolve(score_func, pre_softmax)
    x = np.asarray(logits, np.float64)
    sel = _row_math(lambda l: choice.selects(l, choice.scores(l)), x)
    return sel if bias is None else sel + np.asarray(bias, np.float64)


def router(logits,
           *,
           top_k,
           score_func="softmax",
           pre_softmax=True,
           norm_topk=True,
           groups=1,
           group_topk=1,
           scaling=1.0,
           bias=None):
    """logits [T, E] -> probs [T, E], ids [T, k], weights [T, k] (float64 math).

    The tests' one routing reference: the score function's math is its routing_table row's
    (an unknown name is a ValueError), run in float64; the selection (bias, group-limited
    top-k, ties to the lower index) is written out here, loop by loop."""
    choice = routing_table.resolve(score_func, pre_softmax)
    x = np.asarray(logits, np.float64)
    t, e = x.shape
    dense = _row_math(choice.scores, x)
    probs = _row_math(choice.probs, dense)
    sel_all = selection_scores(x, score_func=score_func, pre_softmax=pre_softmax, bias=bias)
    ids = np.zeros((t, top_k), np.int64)
    for i in range(t):
        sel = sel_all[i]
        if groups > 1:
            per = e // groups
            m = top_k // group_topk
            gscore = np.array(
                [np.sort(sel[g * per:(g + 1) * per])[::-1][:m].sum() for g in range(groups)])
            keep = _topk_ids(gscore, group_topk)
            mask = np.full(e, -np.inf)
            for g in keep:
                mask[g * per:(g + 1) * per] = 0.0
            sel = sel + mask
        ids[i] = _topk_ids(sel, top_k)
    w = weights_for_ids(x,
                        ids,
                        score_func=score_func,
                        pre_softmax=pre_softmax,
                        norm_topk=norm_topk,
                        scaling=scaling)
    return probs, ids, np.asarray(w)


def weights_for_ids(logits,
                    ids,
                    *,
                    score_func="softmax",
                    pre_softmax=True,
                    norm_topk=True,
                    scaling=1.0):
    """The routing weights [T, k] of fixed expert ids [T, k]: the row's weights times scaling,
    jax.numpy in the dtype of `logits` (differentiable; NumPy float64 in, float64 out)."""
    choice = routing_table.resolve(score_func, pre_softmax)
    if isinstance(logits, np.ndarray) and logits.dtype == np.float64:
        return _row_math(lambda l, i: choice.weights(l, choice.scores(l), i, norm_topk) * scaling,
                         logits, ids)
    ids = jnp.asarray(ids)
    return choice.weights(logits, choice.scores(logits), ids, norm_topk) * scaling


def _routing_fields(cfg):
    return dict(score_func=cfg.score_func, pre_softmax=cfg.pre_softmax)


def router_for(logits, cfg, bias):
    """router() with the routing fields of an MoEConfig."""
    return router(np.asarray(logits),
                  top_k=cfg.top_k,
                  norm_topk=cfg.norm_topk,
                  groups=cfg.num_expert_groups,
                  group_topk=cfg.group_topk,
                  scaling=cfg.routed_scaling_factor,
                  bias=None if bias is None else np.asarray(bias),
                  **_routing_fields(cfg))


def selection_scores_for(logits, cfg, bias):
    """selection_scores() with the routing fields of an MoEConfig."""
    return selection_scores(logits, bias=bias, **_routing_fields(cfg))


def weights_for_ids_for(logits, ids, cfg):
    """weights_for_ids() with the routing fields of an MoEConfig."""
    return weights_for_ids(logits,
                           ids,
                           norm_topk=cfg.norm_topk,
                           scaling=cfg.routed_scaling_factor,
                           **_routing_fields(cfg))


def probs_for(logits, cfg):
    """The load-balancing loss's probabilities [T, E] of an MoEConfig's row, in logits' dtype."""
    choice = routing_table.resolve(cfg.score_func, cfg.pre_softmax)
    return choice.probs(choice.scores(logits))


def swiglu(gate, up, weights=None):
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    out = g / (1.0 + np.exp(-g)) * u
    if weights is not None:
        out = out * np.asarray(weights, np.float64)[:, None]
    return out


def swiglu_grads(gate, up, weights, dout):
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    d = np.asarray(dout, np.float64)
    w = np.ones(g.shape[0]) if weights is None else np.asarray(weights, np.float64)
    s = 1.0 / (1.0 + np.exp(-g))
    silu = g * s
    dg = d * w[:, None] * u * (s * (1.0 + g * (1.0 - s)))
    du = d * w[:, None] * silu
    dw = np.sum(d * silu * u, axis=1)
    return dg, du, dw


def swiglu_dw_scale(gate, up, dout):
    """Per row, the sum of |dout * silu(gate) * up|: the magnitude of the terms that the routing
    weight's gradient adds. A float32 sum of terms that cancel has an error of a few ulps of
    this, not of the (possibly much smaller) sum, so dw is compared relative to it."""
    return np.sum(np.abs(np.asarray(dout, np.float64) * swiglu(gate, up)), axis=1)


def permute(x, row_map):
    x = np.asarray(x, np.float64)
    out = np.zeros((len(row_map), ) + x.shape[1:])
    for r, t in enumerate(np.asarray(row_map)):
        if 0 <= t < x.shape[0]:
            out[r] = x[t]
    return out


def unpermute(y, row_map, num_tokens):
    y = np.asarray(y, np.float64)
    out = np.zeros((num_tokens, ) + y.shape[1:])
    for r, t in enumerate(np.asarray(row_map)):
        if 0 <= t < num_tokens:
            out[t] += y[r]
    return out


def permute_index(row_map, num_tokens):
    """(offsets [T + 2], cursor [T + 2], lists [R]) of the CSR inverse of row_map that
    moe_permute_index builds: each token's rows ascending, then slot T, the rows outside [0, T)
    (ascending here; in no particular order in the kernel's)."""
    rm = np.asarray(row_map)
    slot = np.where((rm >= 0) & (rm < num_tokens), rm, num_tokens)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(slot, minlength=num_tokens + 1))])
    cursor = np.concatenate([offsets[1:], offsets[-1:]])
    return offsets, cursor, np.argsort(slot, kind="stable")


def expert_sort(keys, e, k):
    """(order, sorted_keys, row_map, group_sizes) of ops.expert_sort, by NumPy's stable argsort:
    keys outside [0, E) count as E and sort last; row_map is the token order // k (T for them)."""
    key = np.asarray(keys).astype(np.int64)
    key = np.where((key >= 0) & (key < e), key, e)
    order = np.argsort(key, kind="stable")
    srt = key[order]
    row_map = np.where(srt < e, order // k, len(key) // k)
    return (order.astype(np.int32), srt.astype(np.int32), row_map.astype(np.int32),
            np.bincount(key, minlength=e + 1)[:e].astype(np.int32))


def expert_sort_keys(t, k, e, pattern, rng):
    """[T * k] int32 expert keys: 'uniform'; 'skewed' (expert e // 2 takes about 90%); 'one'
    (every copy to the last expert); 'empty' (only even experts); 'dropped' (about a quarter
    not kept: E, E + 3, -1, int32 max)."""
    n = t * k
    keys = rng.integers(0, e, n)
    if pattern == "skewed":
        keys = np.where(rng.random(n) < 0.9, e // 2, keys)
    elif pattern == "one":
        keys = np.full(n, e - 1)
    elif pattern == "empty":
        keys = keys // 2 * 2
    elif pattern == "dropped":
        bad = np.array([e, e + 3, -1, np.iinfo(np.int32).max])
        keys = np.where(rng.random(n) < 0.25, bad[rng.integers(0, 4, n)], keys)
    elif pattern != "uniform":
        raise ValueError(f"pattern={pattern!r}")
    return keys.astype(np.int32)


def aux_loss(probs, f, *, top_k, coeff, num_tokens=None):
    p = np.asarray(probs, np.float64)
    t = p.shape[0] if num_tokens is None else float(num_tokens)
    return coeff * p.shape[1] / (top_k * t * t) * np.sum(p.sum(0) * np.asarray(f, np.float64))


def row_map_for(t, k, e, rng, drop_frac=0.1):
    """A dispatch-like row map: T*k copies sorted by a random expert, some dropped (-> T)."""
    ids = rng.integers(0, e, size=(t, k))
    flat = ids.reshape(-1).copy()
    drop = rng.random(flat.shape) < drop_frac
    flat[drop] = e
    order = np.argsort(flat, kind="stable")
    row_map = np.where(flat[order] < e, order // k, t).astype(np.int32)
    return row_map
