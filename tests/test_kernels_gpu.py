"""The CUDA kernels against their references on a GPU (marked `gpu`; skipped elsewhere).

Tolerances: ||kernel - reference|| / ||reference|| <= 1e-6 for float32 (both sides do the
same float32 math; only summation order and exp/div rounding differ), 1e-2 for bfloat16
(one rounding of the output to 8 mantissa bits). Expert ids must be equal, except where two
candidates' selection scores are within 1e-6 relative of each other (a near-tie whose order
float32 rounding decides); exact ties (integer logits) must break to the lower index exactly.
Outputs are poisoned before each call: a large NaN buffer is allocated and freed so that
XLA's allocator hands its memory to the kernel's outputs; any element the kernel does not
write then shows up as NaN (rel_err returns inf for non-finite outputs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from moe_praxis import ops, routing
from moe_praxis.config import MoEConfig
from moe_praxis.ops.permute import permute_index_cuda
from moe_praxis.ops.router import router_cuda
from tests import kernel_reference as ref
from tests.testutil import poison, router_config

pytestmark = pytest.mark.gpu

F32_TOL, BF16_TOL = 1e-6, 1e-2


@pytest.fixture(autouse=True)
def _need_cuda_kernels():
    info = ops.backend_info()["cuda"]
    if not info["usable"]:
        pytest.skip(f"CUDA kernels not usable here: {info['reason']}")


def _group_near_tie(sel_row, groups, group_topk, m):
    """True if the group_topk-th and next best group scores are within 1e-6 relative."""
    g = np.sort(np.sort(sel_row.reshape(groups, -1), axis=1)[:, ::-1][:, :m].sum(1))[::-1]
    return abs(g[group_topk - 1] - g[group_topk]) <= 1e-6 * abs(g[group_topk - 1])


def _check_ids(ids_k, ids_r, sel_r, tag, groups=1, group_topk=1, top_k=1):
    """ids equal, or the differing picks are near-ties of the reference's selection scores
    (with group-limited routing: or the choice of groups is a near-tie)."""
    ids_k, ids_r = np.asarray(ids_k), np.asarray(ids_r)
    bad = np.any(ids_k != ids_r, axis=1)
    assert bad.mean() < 0.01, f"{tag}: {bad.sum()} of {len(bad)} tokens pick other experts"
    for t in np.nonzero(bad)[0]:
        if groups > 1 and _group_near_tie(sel_r[t], groups, group_topk, top_k // group_topk):
            continue
        a = np.sort(sel_r[t, ids_k[t]])
        b = np.sort(sel_r[t, ids_r[t]])
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"{tag}: token {t} not a near-tie")
    return ~bad


ROUTER_CASES = [
    # (T, E, k, score_func, pre_softmax, norm_topk, groups, group_topk, scaling, bias)
    (1, 8, 2, "softmax", True, True, 1, 1, 1.0, False),
    (37, 64, 8, "softmax", True, False, 1, 1, 1.0, False),
    (4099, 64, 8, "softmax", True, True, 1, 1, 1.0, False),
    (4099, 32, 1, "softmax", True, True, 1, 1, 1.0, False),
    (1003, 128, 4, "softmax", False, True, 1, 1, 1.0, True),
    (1003, 64, 6, "sigmoid", True, True, 1, 1, 2.5, True),
    (513, 200, 3, "softmax", True, True, 1, 1, 1.0, False),  # E not a multiple of 32
    (2051, 256, 8, "sigmoid", True, True, 1, 1, 2.5, True),  # E = 256 without groups
    # group-limited top-k
    (4099, 256, 8, "sigmoid", True, True, 8, 4, 2.5, True),  # DeepSeek-V3 routing
    (777, 256, 8, "softmax", True, True, 16, 2, 1.0, False),
    (1003, 64, 6, "softmax", False, True, 8, 3, 1.0, True),  # 8 lanes per token, 8 groups
    (515, 16, 4, "sigmoid", True, False, 8, 2, 1.0, False),  # groups raise the lanes (2 -> 8)
]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_router_matches_reference(case):
    _router_case(case)


def _router_case(case):
    t, e, k, sf, pre, norm, g, gk, sc, use_bias = case
    cfg = router_config(e, k, sf, pre, norm, g, gk, sc, use_bias)
    s = ref.seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(s), 4)
    logits = 2.0 * jax.random.normal(k1, (t, e), jnp.float32)
    bias = (0.1 * jax.random.normal(k2, (e, )) if use_bias else jnp.zeros((e, ), jnp.float32))
    dprobs = jax.random.normal(k3, (t, e), jnp.float32)
    dw = jax.random.normal(k4, (t, k), jnp.float32)

    kern = jax.jit(functools.partial(router_cuda, **routing.router_args(cfg)))
    poison()
    probs, ids, w = kern(logits, bias)
    r = routing.route_logits_reference(logits, cfg, bias if use_bias else None)
    tag = f"seed={s} case={case}"
    assert ids.dtype == jnp.int32 and ids.shape == (t, k)
    assert np.all((np.asarray(ids) >= 0) & (np.asarray(ids) < e)), tag
    sel = ref.selection_scores_for(logits, cfg, bias)
    same = _check_ids(ids, r.expert_ids, sel, tag, g, gk, k)
    assert ref.rel_err(probs, r.probs) <= F32_TOL, tag
    assert ref.rel_err(np.asarray(w)[same], np.asarray(r.weights)[same]) <= F32_TOL, tag
    # and against the independent float64 NumPy reference
    p64, ids64, w64 = ref.router_for(logits, cfg, bias)
    same64 = _check_ids(ids, ids64, sel, tag + " (numpy)", g, gk, k)
    assert ref.rel_err(probs, p64) <= F32_TOL, tag
    assert ref.rel_err(np.asarray(w)[same64], w64[same64]) <= F32_TOL, tag

    # backward through jax.vjp: kernel vs reference, on tokens whose ids agree
    # inputs are ARGUMENTS of the jitted functions: closed-over arrays become HLO constants, and
    # XLA then constant-folds the reference's top_k / sort at compile time (a test took > 100 s)
    def vjp_of(fn):

        def run(l, b, dp, dw_):
            _, pull = jax.vjp(lambda x: fn(x, b), l)
            return pull((dp, dw_))[0]

        return jax.jit(run)(logits, bias, dprobs, dw)

    poison()
    g_k = vjp_of(lambda l, b: (lambda o: (o[0], o[2]))
                 (router_cuda(l, b, **routing.router_args(cfg))))
    g_r = vjp_of(lambda l, b: (lambda o: (o.probs, o.weights))
                 (routing.route_logits_reference(l, cfg, b if use_bias else None)))
    g_k, g_r = np.asarray(g_k)[same], np.asarray(g_r)[same]
    err = ref.rel_err(g_k, g_r)
    if err > F32_TOL and t * e * (e + k) <= 1 << 22:
        # d logits = J^T (dprobs, dw) is a sum whose terms may cancel (one token: 16 of 650
        # seeds of the (1, 8, 2, softmax) case missed 1e-6 relative to the result, the two
        # float32 gradients both right to a few ulps of the terms): then the error is measured
        # against the terms' magnitudes, |J|^T |(dprobs, dw)|, J from the reference per token
        def one(x):
            o = routing.route_logits_reference(x[None], cfg, bias if use_bias else None)
            return o.probs[0], o.weights[0]

        jp, jw = jax.vmap(jax.jacrev(one))(logits)
        scale = (np.einsum("tie,ti->te", np.abs(np.asarray(jp, np.float64)), np.abs(dprobs)) +
                 np.einsum("tke,tk->te", np.abs(np.asarray(jw, np.float64)), np.abs(dw)))
        assert ref.sum_err(g_k, g_r, scale[same]) <= F32_TOL, tag + " (|J|^T |c| scale)"
    else:
        assert err <= F32_TOL, tag


@pytest.mark.parametrize("sf,pre", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_exact_ties_break_to_lower_index(sf, pre):
    s = ref.seed()
    t, e, k = 1003, 64, 8
    cfg = router_config(e, k, sf, pre, True, 1, 1, 1.0, False)
    # integer logits in {0, 1, 2}: every token has many exactly tied experts
    logits = jax.random.randint(jax.random.key(s), (t, e), 0, 3).astype(jnp.float32)
    poison()
    _, ids, w = jax.jit(functools.partial(router_cuda, **routing.router_args(cfg)))(logits,
                                                                                    jnp.zeros(
                                                                                        (e, )))
    r = routing.route_logits_reference(logits, cfg)
    _, ids64, w64 = ref.router(np.asarray(logits), top_k=k, score_func=sf, pre_softmax=pre)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(r.expert_ids), err_msg=f"seed={s}")
    np.testing.assert_array_equal(np.asarray(ids), ids64, err_msg=f"seed={s}")
    assert ref.rel_err(w, w64) <= F32_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
# (the weighted backward runs one block of 128, 256 or 512 threads per row: (7, 2052) loops twice
# over its 513 bf16 vectors; (65, 4098) is no multiple of bf16's vector width (scalar path) and
# loops over its row)
@pytest.mark.parametrize("rows,h", [(1, 8), (333, 100), (4097, 1408), (7, 2052), (65, 4098)])
@pytest.mark.parametrize("with_weights", [False, True])
def test_swiglu_matches_reference(dtype, rows, h, with_weights):
    s = ref.seed()
    ks = jax.random.split(jax.random.key(s), 4)
    gate = (2 * jax.random.normal(ks[0], (rows, h))).astype(dtype)
    up = jax.random.normal(ks[1], (rows, h)).astype(dtype)
    w = jax.random.uniform(ks[2], (rows, ), jnp.float32) if with_weights else None
    dout = jax.random.normal(ks[3], (rows, h)).astype(dtype)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    tag = f"seed={s}"
    poison()
    out = jax.jit(lambda g, u, ww: ops.swiglu(g, u, ww, backend="cuda"))(gate, up, w)
    assert out.dtype == dtype and out.shape == (rows, h)
    want = ops.swiglu_reference(gate, up, w)
    assert ref.rel_err(out, want) <= tol, tag
    assert ref.rel_err(out, ref.swiglu(gate, up, w)) <= tol, tag

    def grads(backend):
        fn = lambda g, u, ww: jnp.sum(
            (ops.swiglu(g, u, ww, backend=backend).astype(jnp.float32) * dout.astype(jnp.float32)))
        argnums = (0, 1, 2) if with_weights else (0, 1)
        return jax.jit(jax.grad(fn, argnums=argnums))(gate, up, w)

    poison()
    gk, gr = grads("cuda"), grads("xla")
    d64 = ref.swiglu_grads(gate, up, w, dout)
    # the routing weight's gradient (i = 2) is a row sum whose terms cancel: its error is
    # measured against the sum of their magnitudes (a 1-row case failed 1e-6 relative to the
    # sum itself, 1.6e-6, with the kernel and XLA agreeing)
    dw_scale = ref.swiglu_dw_scale(gate, up, dout)
    for i, (a, b) in enumerate(zip(gk, gr)):
        assert a.dtype == b.dtype
        err = ref.rel_err if i < 2 else functools.partial(ref.sum_err, scale=dw_scale)
        assert err(a, b) <= tol, f"{tag} grad {i}"
        assert err(a, d64[i]) <= tol, f"{tag} grad {i} vs numpy"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,k,m", [(1, 1, 64), (1003, 8, 100), (1003, 2, 4096), (4099, 8, 512)])
def test_permute_unpermute_match_reference(dtype, t, k, m):
    s = ref.seed()
    rng = np.random.default_rng(s)
    row_map = jnp.asarray(ref.row_map_for(t, k, 64, rng))
    x = jnp.asarray(rng.standard_normal((t, m)), dtype)
    y = jnp.asarray(rng.standard_normal((t * k, m)), dtype)
    tag = f"seed={s}"
    poison()
    got = jax.jit(lambda a, r: ops.permute(a, r, backend="cuda"))(x, row_map)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ops.permute_reference(x, row_map), np.float32))
    poison()
    back = jax.jit(lambda b, r: ops.unpermute(b, r, t, backend="cuda"))(y, row_map)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert ref.rel_err(back, ops.unpermute_reference(y, row_map, t)) <= tol, tag
    assert ref.rel_err(back, ref.unpermute(y, row_map, t)) <= tol, tag
    # each is the other's backward
    cx = jnp.asarray(rng.standard_normal((t * k, m)), jnp.float32)
    cy = jnp.asarray(rng.standard_normal((t, m)), jnp.float32)
    poison()
    gx = jax.jit(
        jax.grad(
            lambda a: jnp.sum(ops.permute(a, row_map, backend="cuda").astype(jnp.float32) * cx)))(x)
    assert ref.rel_err(gx, ref.unpermute(cx.astype(dtype), row_map, t)) <= tol, tag
    gy = jax.jit(
        jax.grad(lambda b: jnp.sum(
            ops.unpermute(b, row_map, t, backend="cuda").astype(jnp.float32) * cy)))(y)
    assert ref.rel_err(gy, ref.permute(cy.astype(dtype), row_map)) <= tol, tag


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,k,m", [(1, 1, 64), (1003, 8, 100), (1003, 2, 4096), (4099, 8, 512)])
def test_permute_pair_backward_is_one_unpermute_of_both_cotangents(dtype, t, k, m):
    """permute_pair's rows are permute's, bitwise, twice; its backward (the indexed unpermute of
    two: both cotangents summed per token in float32, rounded once) against float64, with
    dropped rows (row_map = T), a negative entry, tokens of no row and a poisoned output."""
    s = ref.seed()
    rng = np.random.default_rng(s)
    rm = ref.row_map_for(t, k, 64, rng)
    rm[rng.integers(0, len(rm))] = -3  # out of range on the other side: read zeros, never written
    row_map = jnp.asarray(rm)
    x = jnp.asarray(rng.standard_normal((t, m)), dtype)
    c1 = jnp.asarray(rng.standard_normal((t * k, m)), dtype)
    c2 = jnp.asarray(rng.standard_normal((t * k, m)) * 3.0, dtype)
    tag = f"seed={s}"
    poison()
    y1, y2 = jax.jit(lambda a, r: ops.permute_pair(a, r, backend="cuda"))(x, row_map)
    want = np.asarray(ops.permute_reference(x, row_map), np.float32)
    np.testing.assert_array_equal(np.asarray(y1, np.float32), want)
    np.testing.assert_array_equal(np.asarray(y2, np.float32), want)

    def loss(a):
        p, q = ops.permute_pair(a, row_map, backend="cuda")
        return jnp.sum(
            p.astype(jnp.float32) * c1.astype(jnp.float32) +
            q.astype(jnp.float32) * c2.astype(jnp.float32))

    poison()
    gx = jax.jit(jax.grad(loss))(x)
    assert gx.dtype == dtype
    want64 = ref.unpermute(np.asarray(c1, np.float64) + np.asarray(c2, np.float64), rm, t)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert ref.rel_err(gx, want64) <= tol, tag
    assert ref.rel_err(gx, ops.unpermute2_reference(c1, c2, row_map, t)) <= tol, tag


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,k,m", [(1, 1, 64), (1003, 8, 100), (1003, 2, 4096), (4099, 8, 512)])
def test_permute_index_kernel_and_the_kernels_that_read_it(dtype, t, k, m):
    """moe_permute_index against NumPy's CSR inverse (offsets and cursor exact, each token's rows
    ascending, the sink slot as a set), then permute / unpermute and the permute's backward
    reading it against the references, outputs poisoned; dropped rows and a negative entry."""
    s = ref.seed()
    rng = np.random.default_rng(s)
    rm = ref.row_map_for(t, k, 64, rng)
    rm[rng.integers(0, len(rm))] = -1
    row_map = jnp.asarray(rm)
    tag = f"seed={s}"
    poison()
    index = np.asarray(jax.jit(lambda r: permute_index_cuda(r, t))(row_map))
    offsets, cursor, order = ref.permute_index(rm, t)
    np.testing.assert_array_equal(index[:t + 2], offsets, tag)
    np.testing.assert_array_equal(index[t + 2:2 * t + 4], cursor, tag)
    lists = index[2 * t + 4:]
    np.testing.assert_array_equal(lists[:offsets[t]], order[:offsets[t]], tag)
    np.testing.assert_array_equal(np.sort(lists[offsets[t]:]), order[offsets[t]:], tag)

    x = jnp.asarray(rng.standard_normal((t, m)), dtype)
    y = jnp.asarray(rng.standard_normal((t * k, m)), dtype)
    idx = jnp.asarray(index)
    poison()
    got = jax.jit(lambda a: ops.permute(a, row_map, backend="cuda", index=idx))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ops.permute_reference(x, row_map), np.float32))
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    poison()
    back = jax.jit(lambda b: ops.unpermute(b, row_map, t, backend="cuda", index=idx))(y)
    assert ref.rel_err(back, ref.unpermute(y, rm, t)) <= tol, tag
    cx = jnp.asarray(rng.standard_normal((t * k, m)), jnp.float32)
    poison()
    gx = jax.jit(
        jax.grad(lambda a: jnp.sum(
            ops.permute(a, row_map, backend="cuda", index=idx).astype(jnp.float32) * cx)))(x)
    assert ref.rel_err(gx, ref.unpermute(cx.astype(dtype), rm, t)) <= tol, tag


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "one", "empty", "dropped"])
# T*k = 1, a tail of 3 keys past 32-key steps, 131072 (32 full 4096-key chunks), a partial last
# chunk, E = 1 and E = 1024 (the kernel's largest: 32.8 KB of counters per block)
@pytest.mark.parametrize("t,k,e", [(1, 1, 1), (37, 3, 5), (16384, 8, 128), (4099, 8, 256),
                                   (50001, 6, 1024), (9000, 2, 1)])
def test_expert_sort_kernel_is_numpys_stable_argsort(pattern, t, k, e):
    """The sort kernels' four outputs exactly equal NumPy's stable argsort (order, sorted keys,
    row map, group sizes), outputs poisoned; keys out of range sort as E."""
    s = ref.seed()
    keys = ref.expert_sort_keys(t, k, e, pattern, np.random.default_rng(s))
    poison()
    got = jax.jit(lambda a: ops.expert_sort(a, e, k, backend="cuda"))(jnp.asarray(keys))
    want = ref.expert_sort(keys, e, k)
    for name, g, w in zip(("order", "sorted_keys", "row_map", "group_sizes"), got, want):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} seed={s}")


@pytest.mark.parametrize("fdtype", [jnp.int32, jnp.float32])  # counts read as they are
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
# (50001, 80): every block of the forward's first pass loops several times, and its grid stride
# is not a multiple of E (the column is advanced by stride mod E). The backward's power-of-two
# kernel (column mask) takes E = 8, 64, 256 (E = 8 with bf16's 8-wide vectors too); E = 80 and
# (333, 4): E = 4 with bf16 (E not a multiple of the vector width) take the general kernel.
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (4099, 64, 8), (1003, 256, 8), (50001, 80, 6),
                                   (333, 4, 2)])
def test_aux_loss_matches_reference(dtype, t, e, k, fdtype):
    s = ref.seed()
    k1, k2 = jax.random.split(jax.random.key(s))
    probs = jax.nn.softmax(jax.random.normal(k1, (t, e)), -1).astype(dtype)
    f = jax.random.randint(k2, (e, ), 0, 2 * t * k // e + 2).astype(fdtype)
    coeff = 0.37
    fn = lambda p: ops.aux_loss(p, f, top_k=k, coeff=coeff, backend="cuda")
    poison()
    loss, g = jax.jit(jax.value_and_grad(lambda p: 2.5 * fn(p)))(probs)
    want = 2.5 * ref.aux_loss(probs, f, top_k=k, coeff=coeff)
    assert abs(float(loss) - want) <= F32_TOL * abs(want), f"seed={s}"
    want_g = 2.5 * coeff * e / (k * t * t) * np.broadcast_to(np.asarray(f, np.float64), (t, e))
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert g.dtype == dtype and ref.rel_err(g, want_g) <= tol, f"seed={s}"


def test_aux_loss_forward_is_bitwise_reproducible():
    # the forward adds per-block partials in a fixed order (no atomics): equal inputs, equal bits
    s = ref.seed()
    k1, k2 = jax.random.split(jax.random.key(s))
    probs = jax.nn.softmax(jax.random.normal(k1, (16384, 64)), -1)
    f = jax.random.randint(k2, (64, ), 0, 4096)
    fn = jax.jit(lambda p, ff: ops.aux_loss(p, ff, top_k=8, coeff=0.01, backend="cuda"))
    first = np.asarray(fn(probs, f))
    for _ in range(5):
        assert np.asarray(fn(probs, f)).tobytes() == first.tobytes(), f"seed={s}"
    want = ref.aux_loss(probs, f, top_k=8, coeff=0.01)
    assert abs(float(first) - want) <= F32_TOL * abs(want), f"seed={s}"


def test_aux_loss_per_sequence_vmap():
    s = ref.seed()
    b, sl, e, k = 3, 129, 16, 2
    k1, k2 = jax.random.split(jax.random.key(s))
    probs = jax.nn.softmax(jax.random.normal(k1, (b, sl, e)), -1)
    f = jax.random.randint(k2, (b, e), 0, 40)
    n = jnp.array([129, 100, 7])
    fn = lambda backend: jax.jit(
        jax.value_and_grad(lambda p: jnp.sum(
            jax.vmap(lambda pp, ff, nn: ops.aux_loss(
                pp, ff, top_k=k, coeff=0.1, num_tokens=nn, backend=backend))(p, f, n))))(probs)
    (lk, gk), (lr, gr) = fn("cuda"), fn("xla")
    assert abs(float(lk) - float(lr)) <= F32_TOL * abs(float(lr)), f"seed={s}"
    assert ref.rel_err(gk, gr) <= F32_TOL, f"seed={s}"


def test_jit_grad_aux_loss_on_sharded_input():
    s = ref.seed()
    devs = jax.devices()
    mesh = jax.make_mesh((len(devs), ), ("data", ), devices=devs)
    t, e, k = 512 * len(devs), 64, 8
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(s), (t, e)), -1)
    probs = jax.device_put(probs, NamedSharding(mesh, P("data", None)))
    f = jnp.arange(e, dtype=jnp.int32)
    loss = lambda p: 3.0 * ops.aux_loss(p, f, top_k=k, coeff=0.1, backend="cuda")
    fn = jax.jit(jax.value_and_grad(loss))
    text = fn.lower(probs).as_text()
    assert "sdy" in text or "mhlo.sharding" in text
    val, g = fn(probs)
    assert abs(float(val) -
               3.0 * ref.aux_loss(probs, f, top_k=k, coeff=0.1)) <= 1e-6 * abs(float(val))
    assert ref.rel_err(g, 3.0 * 0.1 * e / (k * t * t) * np.broadcast_to(np.arange(e), (t, e))) \
        <= F32_TOL


@pytest.mark.parametrize("extra", [{},
                                   dict(score_func="sigmoid", num_expert_groups=4, group_topk=2),
                                   dict(capacity_factor=0.75, drop_policy="position"),
                                   dict(capacity_factor=0.75, drop_policy="weight")],
                         ids=["softmax", "sigmoid-grouped", "capacity-position", "capacity-weight"])
def test_moe_block_cuda_backend_matches_xla(extra):
    s = ref.seed()
    cfg = dict(d_model=64, d_ff=128, num_experts=16, top_k=4, aux_loss_coeff=0.01, **extra)
    c_cuda = MoEConfig(**cfg, kernel_backend="cuda")
    c_xla = MoEConfig(**cfg, kernel_backend="xla")
    params = mp.init_moe_params(jax.random.key(s), c_xla)
    x = jax.random.normal(jax.random.key(s + 1), (2, 333, 64))

    def run(c):

        def loss(p, xx):
            o = mp.moe_block(p, xx, c)
            return jnp.sum(o.y * jnp.sin(xx)) + o.aux_loss, o

        (l, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return l, o, g

    # full float32 matmuls: TF32 would turn the kernels' 1e-7 differences into 1e-3 ones
    with jax.default_matmul_precision("float32"):
        lc, oc, gc = run(c_cuda)
        lx, ox, gx = run(c_xla)
    np.testing.assert_array_equal(np.asarray(oc.tokens_per_expert),
                                  np.asarray(ox.tokens_per_expert))
    assert int(oc.dropped_tokens) == int(ox.dropped_tokens), f"seed={s}"
    assert (int(ox.dropped_tokens) > 0) == ("capacity_factor" in extra), f"seed={s}"
    assert ref.rel_err(oc.y, ox.y) <= 1e-5, f"seed={s}"
    assert abs(float(oc.aux_loss) - float(ox.aux_loss)) <= 1e-6 * abs(float(ox.aux_loss))
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gx)):
        assert ref.rel_err(a, b) <= 1e-5, f"seed={s}"
