"""Independent float64 NumPy references for the CUDA kernels' tests (not the ops code).

Written from the formulas in moe_praxis/routing.py, ops/swiglu.py, ops/permute.py and
ops/aux_loss.py, loop by loop, so that a shared bug in the JAX reference and a kernel shows.
"""

import numpy as np

from tests.testutil import rel_err, seed, sum_err  # noqa: F401  (re-exported for the kernel tests)


def _softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _topk_ids(v, k):
    # descending, ties to the lower index (stable sort of -v)
    return np.argsort(-v, kind="stable")[:k]


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
    """logits [T, E] -> probs [T, E], ids [T, k], weights [T, k] (float64 math)."""
    x = np.asarray(logits, np.float64)
    t, e = x.shape
    b = np.zeros(e) if bias is None else np.asarray(bias, np.float64)
    probs = np.zeros((t, e))
    ids = np.zeros((t, top_k), np.int64)
    w = np.zeros((t, top_k))
    for i in range(t):
        if score_func == "softmax":
            dense = _softmax(x[i])
            probs[i] = dense
            base = dense if pre_softmax else x[i]
        else:
            dense = 1.0 / (1.0 + np.exp(-x[i]))
            probs[i] = dense / dense.sum()
            base = dense
        sel = base + b
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
        if score_func == "softmax" and not pre_softmax:
            w[i] = _softmax(x[i, ids[i]])
        else:
            w[i] = dense[ids[i]]
            if norm_topk and top_k == 1:
                w[i] = 1.0
            elif norm_topk:
                w[i] = w[i] / (w[i].sum() + 1e-20)
    return probs, ids, w * scaling


def router_for(logits, cfg, bias):
    """router() with the routing fields of an MoEConfig."""
    return router(np.asarray(logits),
                  top_k=cfg.top_k,
                  score_func=cfg.score_func,
                  pre_softmax=cfg.pre_softmax,
                  norm_topk=cfg.norm_topk,
                  groups=cfg.num_expert_groups,
                  group_topk=cfg.group_topk,
                  scaling=cfg.routed_scaling_factor,
                  bias=np.asarray(bias))


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
