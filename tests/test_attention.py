"""GroupedQueryAttention and moe_praxis.attention on the CPU (the XLA route).

The oracle is a float64 NumPy attention (softmax(scale q k^T + mask) v, each key/value head
repeated for its G query heads) with its hand-written backward; the float32 routes must
match it to 1e-5 of the output's largest magnitude (float32 rounding of sums over a few
dozen terms). Masks are Praxis's own (causal_segment_mask of random segment ids), so the
packed case is the one data.packing='documents' trains on.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis  # noqa: F401  (applies the Praxis compat shims)
from configs import models
from moe_praxis import attention as attn
from moe_praxis.praxis.attention import GroupedQueryAttention
from praxis import base_layer, pax_fiddle
from praxis.layers import attentions

from tests import decode_util

B, T, N, H, D = 2, 12, 4, 8, 16
TOL = 1e-5


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _segments(rng, packed):
    """[B, T] int32: one segment, or runs 1, 2, ... and a padding run of 0s (packing's rows)."""
    if not packed:
        return np.ones((B, T), np.int32)
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - 1), size=3, replace=False))
        seg = np.zeros(T, np.int32)
        for i, (a, b) in enumerate(zip([0, *cuts[:-1]], cuts), 1):
            seg[a:b] = i
        rows.append(seg)  # the last run (cuts[-1]:T) is padding, 0
    return np.stack(rows)


def _mask(seg):
    """Praxis's additive causal segment mask [B, 1, T, T] (float32)."""
    return attentions.causal_segment_mask(jnp.asarray(seg), jnp.float32)


def _reference(q, k, v, seg, scale, do):
    """float64 attention and its backward: q [B,T,N,H], k, v [B,T,K,H], do [B,T,N,H] ->
    (o, dq, dk, dv). Each key/value head serves N/K consecutive query heads."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    t = np.arange(q.shape[1])
    ok = (seg[:, :, None] == seg[:, None, :]) & (t[:, None] >= t[None, :])[None]
    s = scale * np.einsum("btnh,bsnh->bnts", q, kr)
    s = np.where(ok[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", p, vr)
    dp = np.einsum("btnh,bsnh->bnts", do, vr)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, kr)
    dkr = scale * np.einsum("bnts,btnh->bsnh", ds, q)
    dvr = np.einsum("bnts,btnh->bsnh", p, do)

    def fold(x):  # [B, S, N, H] -> [B, S, K, H]: the repeated heads' gradients summed
        return x.reshape(x.shape[0], x.shape[1], -1, g, x.shape[3]).sum(3)

    return o, dq, fold(dkr), fold(dvr)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("kv_heads", [N, 2, 1], ids=["mha", "gqa", "mqa"])
def test_xla_route_matches_float64_reference(packed, kv_heads):
    rng = np.random.default_rng()
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, kv_heads, H)).astype(np.float32)
    v = rng.standard_normal((B, T, kv_heads, H)).astype(np.float32)
    do = rng.standard_normal((B, T, N, H)).astype(np.float32)
    seg = _segments(rng, packed)
    mask, scale = _mask(seg), H**-0.5
    plan = attn.choose("auto", q, k, v, packed=packed, need_mask=False)
    assert plan.impl == "xla" and "not CUDA" in plan.reason

    def f(q, k, v):
        return attn.attend(q, k, v, mask, plan, scale)

    out, vjp = jax.vjp(f, q, k, v)
    got = (out, *vjp(jnp.asarray(do)))
    want = _reference(q, k, v, seg, scale, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < TOL, (name, _rel(a, b))


def test_segment_offsets_are_the_runs_of_the_mask():
    rng = np.random.default_rng()
    seg = _segments(rng, True)
    starts = attn.segment_starts(_mask(seg))
    want_starts = np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    np.testing.assert_array_equal(np.asarray(starts), want_starts)
    lengths, offsets = (np.asarray(x) for x in attn.segment_offsets(starts))
    assert lengths.shape == (B, T) and offsets.shape == (B, T + 1)
    for b in range(B):
        begin = np.flatnonzero(want_starts[b])
        m = len(begin)
        np.testing.assert_array_equal(offsets[b, :m], begin)
        np.testing.assert_array_equal(lengths[b, :m], np.diff(np.append(begin, T)))
        assert (offsets[b, m:] == -1).all() and (lengths[b, m:] == -1).all()


def test_errors_name_the_value():
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError,
                       match=r"attention_impl='cudnn' cannot run: the backend is "
                       r"'cpu', not CUDA; use 'auto' or 'xla'"):
        attn.choose("cudnn", x, x, x, packed=False, need_mask=False)
    with pytest.raises(ValueError,
                       match=r"attention_impl='flash' is invalid; valid: 'auto', "
                       r"'xla', 'cudnn'"):
        attn.choose("flash", x, x, x, packed=False, need_mask=False)
    for field, value, what in (("num_kv_heads", 3, "a divisor of num_heads=4"),
                               ("qk_norm", "layer", "valid: (None, 'per_head', 'full')"),
                               ("atten_dropout_prob", 0.1, "is not supported; set 0.0")):
        layer = _layer(**{field: value})
        with pytest.raises(ValueError,
                           match=re.escape(f"{field}={value!r}") + ".*" + re.escape(what)):
            with base_layer.JaxContext.new_context():
                layer.init(jax.random.PRNGKey(0), *_layer_inputs(np.random.default_rng()))


# ------------------------------------------------------------------------ the layer


def _layer(**kw):
    kw.setdefault("num_kv_heads", None)
    return pax_fiddle.instantiate(
        pax_fiddle.Config(GroupedQueryAttention,
                          name="atten",
                          input_dim=D,
                          hidden_dim=N * H,
                          num_heads=N,
                          dim_per_head=H,
                          internal_enable_per_dim_scale=False,
                          use_rotary_position_emb=True,
                          **kw))


def _layer_inputs(rng, packed=False):
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    seg = _segments(rng, packed)
    pos = jnp.asarray(_positions(seg))
    return x, x, x, _mask(seg), pos, pos


def _apply(layer, params, inputs):
    with base_layer.JaxContext.new_context():
        return layer.apply({"params": params}, *inputs)[0]


def _rms(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _rotary(x, pos, base=10_000.0):
    """Praxis's RotaryPositionalEmbedding in float64: x [B, T, n, H], pos [B, T]."""
    h = x.shape[-1] // 2
    angle = np.asarray(pos, np.float64)[:, :, None, None] / base**(2 * np.arange(h) / (2 * h))
    a, b = x[..., :h], x[..., h:]
    return np.concatenate(
        [a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)


def _init(layer, inputs, rng, qk_norm=None):
    with base_layer.JaxContext.new_context():
        p = layer.init(jax.random.PRNGKey(int(rng.integers(1 << 30))), *inputs)["params"]
    for child in ("query", "key", "value"):  # random biases (they start at zero)
        b = p[child]["b"]
        p[child]["b"] = jnp.asarray(0.3 * rng.standard_normal(b.shape), b.dtype)
    if qk_norm:  # random scales: a norm applied in the wrong place (after the rotation) shows
        for child in ("query_norm", "key_norm"):
            s = p[child]["scale"]
            p[child]["scale"] = jnp.asarray(1 + 0.5 * rng.standard_normal(s.shape), s.dtype)
    return p


@pytest.mark.parametrize("qk_norm", [None, "per_head", "full"])
def test_layer_matches_float64_reference(qk_norm):
    """The layer (2 key/value heads, rotary embedding, packed rows, the q/k norm before the
    rotation) against the same computation in float64 NumPy."""
    rng = np.random.default_rng()
    inputs = _layer_inputs(rng, packed=True)
    layer = _layer(num_kv_heads=2, qk_norm=qk_norm)
    p = _init(layer, inputs, rng, qk_norm)
    assert p["key"]["w"].shape == (D, 2, H) and p["query"]["w"].shape == (D, N, H)
    if qk_norm:
        assert p["key_norm"]["scale"].shape == ((H, ) if qk_norm == "per_head" else (2 * H, ))
    got = _apply(layer, p, inputs)
    x = np.asarray(inputs[0], np.float64)

    def proj(child):
        return (np.einsum("btd,dnh->btnh", x, np.asarray(p[child]["w"], np.float64)) +
                np.asarray(p[child]["b"], np.float64))

    def norm(y, child):
        if not qk_norm:
            return y
        w = p[child]["scale"]
        if qk_norm == "per_head":
            return _rms(y, w)
        return _rms(y.reshape(B, T, -1), w).reshape(y.shape)

    pos, seg = inputs[4], np.asarray(_segments_of(inputs[3]))
    q = _rotary(norm(proj("query"), "query_norm"), pos)
    k = _rotary(norm(proj("key"), "key_norm"), pos)
    o = _reference(q, k, proj("value"), seg, H**-0.5, np.zeros_like(q))[0]
    want = (np.einsum("btnh,dnh->btd", o, np.asarray(p["post"]["w"], np.float64)) +
            np.asarray(p["post"]["b"], np.float64))
    assert _rel(got, want) < TOL, _rel(got, want)


def _segments_of(mask):
    """Segment ids [B, T] whose causal segment mask is ``mask`` (runs numbered from 1)."""
    return np.cumsum(np.asarray(attn.segment_starts(mask)), axis=1)


@pytest.mark.parametrize("qk_norm", [None, "per_head", "full"])
def test_gqa_layer_equals_mha_with_repeated_kv_heads(qk_norm):
    """K = 2 key/value heads equal multi-head attention whose key/value weights (and key norm
    scales) repeat each of them for its N/K query heads."""
    rng = np.random.default_rng()
    inputs = _layer_inputs(rng, packed=True)
    gqa = _layer(num_kv_heads=2, qk_norm=qk_norm)
    p = _init(gqa, inputs, rng, qk_norm)
    mha = {k: dict(v) for k, v in p.items()}
    for child in ("key", "value"):
        mha[child]["w"] = jnp.repeat(p[child]["w"], N // 2, axis=1)  # [D, K, H]
        mha[child]["b"] = jnp.repeat(p[child]["b"], N // 2, axis=0)  # [K, H]
    if qk_norm == "full":
        mha["key_norm"]["scale"] = jnp.repeat(p["key_norm"]["scale"].reshape(2, H), N // 2,
                                              axis=0).reshape(-1)
    got = _apply(gqa, p, inputs)
    want = _apply(_layer(qk_norm=qk_norm), mha, inputs)
    assert _rel(got, want) < TOL, _rel(got, want)


def _praxis_lm(new: bool, **kw):
    cfg = models.transformer_lm(vocab_size=32,
                                model_dims=D,
                                hidden_dims=32,
                                num_layers=2,
                                num_heads=N,
                                num_experts=4,
                                top_k=2,
                                **kw)
    if not new:  # the attention every run before GroupedQueryAttention trained with
        cfg.stacked_transformer_tpl.transformer_layer_params_tpl.tr_atten_tpl = (pax_fiddle.Config(
            attentions.DotProductAttention,
            use_rotary_position_emb=True,
            internal_enable_per_dim_scale=False))
    return pax_fiddle.instantiate(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_mha_checkpoints_load_and_give_the_same_loss(packed):
    """An LM with Praxis's DotProductAttention (every earlier run) and one with
    GroupedQueryAttention(num_kv_heads=None) have the same variables (names, shapes), and the
    old variables give the new model the same logits, float32 rounding apart."""
    rng = np.random.default_rng()
    ids = jnp.asarray(rng.integers(0, 32, (B, T)), jnp.int32)
    pad = jnp.zeros((B, T), jnp.float32)
    kw = {}
    if packed:
        seg = _segments(rng, True)
        kw = dict(segment_ids=jnp.asarray(seg), segment_pos=jnp.asarray(_positions(seg)))
    old, new = _praxis_lm(False), _praxis_lm(True)
    with base_layer.JaxContext.new_context():
        v_old = old.init(jax.random.PRNGKey(int(rng.integers(1 << 30))), ids, pad)
        v_new = new.init(jax.random.PRNGKey(0), ids, pad)
        shapes = jax.tree_util.tree_map(jnp.shape, v_old["params"])
        assert shapes == jax.tree_util.tree_map(jnp.shape, v_new["params"])
        want = old.apply(v_old, ids, pad, **kw).logits
        got = new.apply(v_old, ids, pad, **kw).logits
    assert _rel(got, want) < TOL, _rel(got, want)


def _positions(seg):
    pos = np.zeros(seg.shape, np.int32)
    for t in range(1, seg.shape[1]):
        pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
    return pos


@pytest.mark.slow
def test_kv_cache_equals_recompute_with_gqa():
    """extend_step after a prefix fprop equals the full fprop at every later position, with
    2 key/value heads and per-head q/k norms; the cache holds the 2 heads."""
    lm = pax_fiddle.instantiate(_praxis_cfg())
    ids = jax.random.randint(jax.random.PRNGKey(int(np.random.default_rng().integers(99))), (B, T),
                             0, 32)
    pad = jnp.zeros((B, T), jnp.float32)
    with decode_util.context():
        variables = lm.init(jax.random.PRNGKey(7), ids, pad)
    variables = {k: v for k, v in variables.items() if k != base_layer.DECODE_CACHE}
    start = 4
    logits, cache = decode_util.prefill(lm, variables, ids, start)
    kv = [
        x.shape for p, x in jax.tree_util.tree_flatten_with_path(cache)[0]
        if "key_state" in jax.tree_util.keystr(p)
    ]
    assert kv and all(s[-2:] == (2, H) for s in kv), kv
    for t, got, cache in decode_util.extend_steps(lm, variables, cache, ids, start):
        assert _rel(got, logits[:, t]) < TOL, (t, _rel(got, logits[:, t]))


def _praxis_cfg():
    return models.transformer_lm(vocab_size=32,
                                 model_dims=D,
                                 hidden_dims=32,
                                 num_layers=2,
                                 num_heads=N,
                                 dim_per_head=H,
                                 num_kv_heads=2,
                                 qk_norm="per_head",
                                 num_experts=4,
                                 top_k=2,
                                 repeat=True)


# ------------------------------------------------------------------ cuDNN against XLA (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_cudnn_route_matches_xla_route(packed, kv_heads):
    """cuDNN's flash attention (causal, or packed segments read from Praxis's mask) against
    the XLA route on the same bf16 inputs: outputs and the three input gradients. Both
    accumulate in float32 but round P (and dP) to bf16 in different places: 2e-2 of the
    largest magnitude."""
    b, t, n, h = 2, 512, 8, 128
    rng = np.random.default_rng()
    q, do = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv_heads, h)), jnp.bfloat16) for _ in range(2))
    seg = np.ones((b, t), np.int32)
    if packed:
        for r in range(b):
            cuts = np.sort(rng.choice(np.arange(1, t - 1), size=5, replace=False))
            seg[r] = np.searchsorted(cuts, np.arange(t), side="right") + 1
            seg[r, cuts[-1]:] = 0  # a padding run at the end, as packing writes it
    mask = attentions.causal_segment_mask(jnp.asarray(seg), jnp.bfloat16)
    cudnn = attn.choose("auto", q, k, v, packed=packed, need_mask=False)
    assert cudnn.impl == "cudnn" and cudnn.packed == packed, cudnn
    xla = attn.AttentionPlan("xla", False, "reference")

    def run(plan):
        out, vjp = jax.vjp(lambda q, k, v: attn.attend(q, k, v, mask, plan, h**-0.5), q, k, v)
        return (out, *vjp(do))

    got, want = jax.jit(lambda: run(cudnn))(), jax.jit(lambda: run(xla))()
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, w) < 2e-2, (name, _rel(a, w))


@pytest.mark.parametrize("dim_per_head, want", [(None, 8), (16, 16)])
def test_transformer_lm_scales_queries_by_the_head_dim(dim_per_head, want):
    """With dim_per_head given (Qwen3-like: 32 heads of 128 at d_model 2048), the logits are
    scaled by 1/sqrt(dim_per_head), not Praxis's 1/sqrt(model_dims / num_heads)."""
    lm = models.transformer_lm(model_dims=32,
                               hidden_dims=64,
                               num_layers=1,
                               num_heads=4,
                               num_experts=4,
                               dim_per_head=dim_per_head)
    tpl = lm.stacked_transformer_tpl.transformer_layer_params_tpl.tr_atten_tpl
    layer = base_layer.instantiate(
        pax_fiddle.Config(tpl.__fn_or_cls__,
                          name="atten",
                          input_dim=32,
                          hidden_dim=32,
                          num_heads=4,
                          dim_per_head=dim_per_head or 8,
                          **{
                              k: getattr(tpl, k)
                              for k in ("scale_query_by_dim_per_head",
                                        "internal_enable_per_dim_scale")
                          }))
    assert layer._scale() == pytest.approx(want**-0.5, rel=1e-6)
