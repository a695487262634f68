"""An independent per-expert loop reference of the MoE block.

Routing decisions (which experts, which copies are dropped) are made in NumPy float64 with
explicit loops (the score functions' math from tests/kernel_reference.py, the tests' one routing
reference, which reads it from moe_praxis.ops.routing_table); the differentiable part (weights, expert FFNs, losses) is dense jax.numpy in
float32 at HIGHEST precision: every expert processes every token and the result is masked by
the combine weight, so gradients come from jax.grad of this reference.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis as mp
from tests import kernel_reference

HI = jax.lax.Precision.HIGHEST


def block_inputs(cfg, shape, seed, dtype=jnp.float32, param_dtype=jnp.float32):
    """Fresh inputs of a moe_block test, drawn from `seed`: (params (init_moe_params in
    param_dtype), x [shape] in dtype, cot [shape] float32 (a cotangent for y))."""
    kp, kx, kc = jax.random.split(jax.random.key(seed), 3)
    params = mp.init_moe_params(kp, cfg, param_dtype)
    return params, jax.random.normal(kx, shape, dtype), jax.random.normal(kc, shape, jnp.float32)


def reference_decisions(x2, params, cfg, valid):
    """NumPy float64: expert ids [T, k] (kernel_reference.router, the tests' routing reference)
    and keep mask [T, k] (capacity), by explicit loops."""
    x64 = np.asarray(x2, np.float64)
    logits = x64 @ np.asarray(params["router"], np.float64)
    if cfg.router_logit_cap > 0:
        logits = cfg.router_logit_cap * np.tanh(logits / cfg.router_logit_cap)
    bias = np.asarray(params["expert_bias"], np.float64) if "expert_bias" in params else None
    t_num, e = logits.shape
    k = cfg.top_k
    _, ids, _ = kernel_reference.router_for(logits, cfg, bias)
    keep = np.asarray(valid, bool)[:, None].repeat(k, 1)
    if cfg.capacity_factor is not None:
        n_valid = t_num  # capacity is computed on the block's token count (rows of x)
        cap = max(1, math.ceil(cfg.capacity_factor * n_valid * k / e))
        load = np.zeros(e, np.int64)
        keep = np.zeros((t_num, k), bool)
        if cfg.drop_policy == "position":
            order = [(t, j) for j in range(k) for t in range(t_num)]
        else:
            w = np.asarray(reference_weights(jnp.asarray(x2), params, cfg, ids)[0])
            flat = [(t, j) for t in range(t_num) for j in range(k)]
            order = sorted(flat, key=lambda tj: -w[tj[0], tj[1]])  # sorted() is stable
        for t, j in order:
            if not valid[t]:
                continue
            if load[ids[t, j]] < cap:
                load[ids[t, j]] += 1
                keep[t, j] = True
    return ids, keep


def reference_weights(x2, params, cfg, ids):
    """jnp float32 combine weights [T, k] for fixed ids (differentiable in x and router)."""
    logits = jnp.dot(x2.astype(jnp.float32), params["router"].astype(jnp.float32), precision=HI)
    if cfg.router_logit_cap > 0:
        logits = cfg.router_logit_cap * jnp.tanh(logits / cfg.router_logit_cap)
    w = kernel_reference.weights_for_ids_for(logits, jnp.asarray(ids), cfg)
    return w, logits


def _act(name):
    return {
        "silu": lambda v: v / (1 + jnp.exp(-v)),
        "relu": lambda v: jnp.maximum(v, 0),
        "gelu": lambda v: jax.nn.gelu(v)
    }[name]


def reference_moe(params, x, cfg, valid=None, decisions=None):
    """Returns (y [..., M], aux_loss, z_loss, tokens_per_expert [E], dropped)."""
    x2 = x.reshape(-1, cfg.d_model).astype(jnp.float32)
    t_num = x2.shape[0]
    e, k = cfg.num_experts, cfg.top_k
    if valid is None:
        valid = np.ones(t_num, bool)
    ids, keep = decisions if decisions is not None else reference_decisions(x2, params, cfg, valid)
    w, logits = reference_weights(x2, params, cfg, ids)
    vmask = np.asarray(valid, bool)
    combine = np.zeros((t_num, k, e), np.float32)
    for t in range(t_num):
        for j in range(k):
            if keep[t, j]:
                combine[t, j, ids[t, j]] = 1.0
    dense_w = jnp.einsum("tk,tke->te", w, jnp.asarray(combine), precision=HI)  # [T, E]
    y = jnp.zeros_like(x2)
    act = _act(cfg.activation)
    for ex in range(e):
        up = jnp.dot(x2, params["wi_up"][ex], precision=HI)
        if cfg.gated:
            h = act(jnp.dot(x2, params["wi_gate"][ex], precision=HI)) * up
        else:
            h = act(up)
        y = y + dense_w[:, ex:ex + 1] * jnp.dot(h, params["wo"][ex], precision=HI)
    # Statistics over valid tokens only.
    counts = np.zeros(e, np.int64)
    counts1 = np.zeros(e, np.int64)
    for t in range(t_num):
        if vmask[t]:
            for j in range(k):
                counts[ids[t, j]] += 1
            counts1[ids[t, 0]] += 1
    n = max(int(vmask.sum()), 1)
    p = kernel_reference.probs_for(logits, cfg)
    p = p * jnp.asarray(vmask, jnp.float32)[:, None]
    if cfg.aux_loss_type == "switch":
        aux = cfg.aux_loss_coeff * e / (k * n * n) * jnp.sum(p.sum(0) * counts)
    elif cfg.aux_loss_type == "gshard":
        aux = cfg.aux_loss_coeff * e / (n * n) * jnp.sum(p.sum(0) * counts1)
    else:  # per sequence
        s = x.shape[-2]
        losses = []
        for b in range(t_num // s):
            sl = slice(b * s, (b + 1) * s)
            cb = np.zeros(e)
            for t in range(b * s, (b + 1) * s):
                if vmask[t]:
                    for j in range(k):
                        cb[ids[t, j]] += 1
            nb = max(int(vmask[sl].sum()), 1)
            losses.append(cfg.aux_loss_coeff * e / (k * nb * nb) * jnp.sum(p[sl].sum(0) * cb))
        aux = jnp.mean(jnp.stack(losses))
    lse = jax.nn.logsumexp(logits, axis=-1)
    z = cfg.z_loss_coeff * jnp.sum(lse * lse * jnp.asarray(vmask, jnp.float32)) / n
    dropped = int((vmask[:, None] & ~keep).sum())
    return y.reshape(x.shape), aux, z, counts, dropped
