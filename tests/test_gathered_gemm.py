"""ops.gathered_gemm: the expert projections reading x's rows by the dispatch's row map.

CPU: the op (xla backend) and its gradients against a float64 NumPy loop over the gathered rows
(fresh random inputs, the group-size patterns of the grouped GEMM tests, row maps with dropped
rows (T), negative entries and rows past sum(group_sizes)); what the backward keeps (x, not the
[R, K] rows); the lowering for CUDA on a faked Hopper (the gathered kernels, one unpermute of
both projections' row gradients, no permute); the configuration rule and the errors.
GPU (the `gpu` marker): the kernels against the same float64 loop, outputs poisoned first, on
every built tile.

Tolerances: float32 1e-5 norm-wise (the reference's sums in float32 against float64); bf16
1e-2 (float32 accumulation, one bf16 rounding of each output, as the grouped GEMM tests).
"""

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis import experts, ops
from moe_praxis.dispatch import gathered
from moe_praxis.ops import grouped_gemm_tiles as tiles
from tests.ep_util import sharded_block
from tests.grouped_gemm_util import KINDS, _cuda_or_skip, _fake_device, cuda_module, make_sizes
from tests.testutil import rel_err
from tests.testutil import seed as _seed

# the modules (ops.gathered_gemm and ops.permute are the functions)
gm = importlib.import_module("moe_praxis.ops.gathered_gemm")
pm = importlib.import_module("moe_praxis.ops.permute")
gu = importlib.import_module("moe_praxis.ops.gate_up")

F32_TOL = 1e-5
BF16_TOL = 1e-2


def _case(t, r, k, ns, e, kind, dtype, seed):
    """x [T, K], row_map [R] (tokens, with T and -1 entries: zero rows), weights [E, K, n] for
    n in ns, group sizes of `kind` over R rows, output gradients [R, n]."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 2 + 2 * len(ns))
    x = jax.random.normal(keys[0], (t, k), jnp.float32).astype(dtype)
    row_map = rng.integers(0, t, r)
    row_map[rng.random(r) < 0.1] = t  # dropped / padded rows
    row_map[rng.random(r) < 0.05] = -1
    ws = tuple((jax.random.normal(keys[2 + i], (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
               for i, n in enumerate(ns))
    douts = tuple(
        jax.random.normal(keys[2 + len(ns) + i], (r, n), jnp.float32).astype(dtype)
        for i, n in enumerate(ns))
    gs = jnp.asarray(make_sizes(kind, r, e, rng), jnp.int32)
    return x, jnp.asarray(row_map, jnp.int32), ws, gs, douts


def _loop(x, row_map, ws, gs, douts):
    """float64: outs, dx, dws of sum_i <out_i, dout_i>."""
    x = np.asarray(x, np.float64)
    t = x.shape[0]
    rm = np.asarray(row_map)
    ok = (rm >= 0) & (rm < t)
    rows = np.where(ok[:, None], x[np.clip(rm, 0, t - 1)], 0.0)
    dx = np.zeros_like(x)
    outs, dws = [], []
    for w, d in zip(ws, douts):
        w, d = np.asarray(w, np.float64), np.asarray(d, np.float64)
        out = np.zeros((rows.shape[0], w.shape[2]))
        dw = np.zeros_like(w)
        drows = np.zeros_like(rows)
        start = 0
        for e, size in enumerate(np.asarray(gs)):
            sl = slice(start, start + size)
            out[sl] = rows[sl] @ w[e]
            dw[e] = rows[sl].T @ d[sl]
            drows[sl] = d[sl] @ w[e].T
            start += size
        np.add.at(dx, rm[ok], drows[ok])
        outs.append(out)
        dws.append(dw)
    return outs, dx, dws


def _run(x, row_map, ws, gs, douts, backend):

    def loss(a, b):
        outs = ops.gathered_gemm(a, row_map, b, gs, backend=backend)
        return sum(
            jnp.sum(o.astype(jnp.float32) * d.astype(jnp.float32))
            for o, d in zip(outs, douts)), outs

    (_, outs), (dx, dws) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, ws)
    return outs, dx, dws


def _check(got, want, tol, tag):
    outs, dx, dws = got
    w_outs, w_dx, w_dws = want
    for o, w in zip(outs, w_outs):
        assert rel_err(o, w) <= tol, f"out {tag}"
    assert rel_err(dx, w_dx) <= tol, f"dx {tag}"
    for o, w in zip(dws, w_dws):
        assert rel_err(o, w) <= tol, f"dw {tag}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ns", [(24, ), (16, 40)])
def test_reference_against_float64(kind, ns):
    s = _seed()
    x, rm, ws, gs, douts = _case(37, 101, 16, ns, 6, kind, jnp.float32, s)
    got = _run(x, rm, ws, gs, douts, "xla")
    _check(got, _loop(x, rm, ws, gs, douts), F32_TOL, f"seed={s} kind={kind} ns={ns}")
    total = int(np.asarray(gs).sum())
    assert not np.asarray(got[0][0][total:]).any()  # rows past the sum are zero


def test_backward_keeps_x_not_the_gathered_rows():
    s = _seed()
    x, rm, ws, gs, _ = _case(32, 96, 16, (24, 24), 4, "balanced", jnp.float32, s)

    def f(a, b):
        return sum(jnp.sum(o) for o in ops.gathered_gemm(a, rm, b, gs, backend="xla"))

    shapes = [tuple(aval.shape) for aval, _ in saved_residuals(f, x, ws)]
    assert (96, 16) not in shapes, shapes  # no [R, K] rows
    assert (32, 16) in shapes, shapes


def test_lowered_for_cuda_reads_x_by_index(monkeypatch):
    """On a faked Hopper, the fwd+bwd of the two projections: two gathered forwards, two
    gathered wgrads, two dgrads, one unpermute summing both row gradients, and no permute."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    s = _seed()
    x, rm, ws, gs, _ = _case(64, 256, 64, (96, 96), 8, "balanced", jnp.bfloat16, s)

    def step(a, b):
        return jax.value_and_grad(lambda u, v: sum(
            jnp.sum(o.astype(jnp.float32)) for o in ops.gathered_gemm(u, rm, v, gs)),
                                  argnums=(0, 1))(a, b)

    text = cuda_module(jax.jit(step), x, ws)
    targets = re.findall(r"custom_call @(moe_\w+)", text)
    assert targets.count("moe_grouped_gemm_gather_fwd") == 2, targets
    assert targets.count("moe_grouped_gemm_gather_wgrad") == 2, targets
    assert targets.count("moe_grouped_gemm_dgrad") == 2, targets
    assert targets.count("moe_permute_index") == 1, targets
    assert not {"moe_permute", "moe_permute_indexed", "moe_grouped_gemm_fwd"} & set(targets)
    twos = re.findall(r"custom_call @moe_unpermute_indexed\(.*two = (true|false)", text)
    assert twos == ["true"], twos
    built = {int(v) for v in re.findall(r"gather_\w+\(.*tile = (\d+)", text)}
    assert built and built <= set(gm.GATHER_TILES), built


@pytest.mark.parametrize("op,dims", [("fwd", (131072, 2048, 768, 128)),
                                     ("fwd", (2048, 2048, 768, 128)),
                                     ("wgrad", (131072, 2048, 768, 128)),
                                     ("wgrad", (16384, 7168, 2048, 8))])
def test_config_is_the_rule_on_a_built_tile(monkeypatch, op, dims):
    monkeypatch.delenv(tiles.ENV_TILE, raising=False)
    tile, raster, swizzle, split = tiles.parse_config(gm.gather_config(op, *dims))
    assert tile in gm.GATHER_TILES
    rule = tiles.parse_config(tiles.choose_config(op, *dims))
    if rule[0] in gm.GATHER_TILES:
        assert (tile, raster, swizzle, split) == rule
    monkeypatch.setenv(tiles.ENV_TILE, "coop_256x128_c2x1/along_n/s1")  # not built gathered
    assert tiles.parse_config(gm.gather_config(op, *dims))[0] == gm.GATHER_TILES[-1]


def test_errors_name_the_value(monkeypatch):
    x = jnp.zeros((8, 16), jnp.bfloat16)
    w = jnp.zeros((2, 16, 8), jnp.bfloat16)
    rm = jnp.zeros((10, ), jnp.int32)
    gs = jnp.array([5, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"weight \(2, 12, 8\) is invalid; valid: \[E=2, K=16"):
        ops.gathered_gemm(x, rm, (jnp.zeros((2, 12, 8), jnp.bfloat16), ), gs)
    with pytest.raises(ValueError, match="one or two weights; got .* 3 weights"):
        ops.gathered_gemm(x, rm, (w, w, w), gs)
    with pytest.raises(ValueError, match="row_map must be integers, got dtype float32"):
        ops.gathered_gemm(x, rm.astype(jnp.float32), (w, ), gs)
    with pytest.raises(ValueError, match="two inputs .* needs the permute index"):
        pm.unpermute_rows(x, rm, 8, None, x)
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    monkeypatch.setenv(ops.backend.ENV_GROUPED_GEMM, "sm80")
    assert "sm80 family runs" in gm.gather_unsupported(x, (w, ), "cuda")
    with pytest.raises(ValueError, match="cannot run the CUDA kernels here: .*sm80"):
        ops.gathered_gemm(x, rm, (w, ), gs, backend="cuda")
    monkeypatch.delenv(ops.backend.ENV_GROUPED_GEMM)
    assert "bf16" in gm.gather_unsupported(x.astype(jnp.float32), (w, ), "cuda")
    assert gm.gather_unsupported(x, (w, ), "cuda") == ""


def _fused_case(seed, dtype, t=37, r=101, k=16, h=24, e=6, kind="skewed"):
    x, rm, (w, ), gs, _ = _case(t, r, k, (2 * h, ), e, kind, dtype, seed)
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    rw = jax.random.uniform(keys[0], (r, ), jnp.float32)
    dact = jax.random.normal(keys[1], (r, h), jnp.float32).astype(dtype)
    return x, rm, w, gs, rw, dact


def _fused_grads(fn, x, w, rw, dact):
    """(act, (dx, dw, drw)) of sum(fn(x, w, rw) * dact)."""

    def loss(a, b, c):
        out = fn(a, b, c)
        return jnp.sum(out.astype(jnp.float32) * dact.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, rw)
    return out, grads


@pytest.mark.parametrize("kind", KINDS)
def test_gathered_gate_up_swiglu_equals_the_fused_op_on_permuted_rows(kind):
    """ops.gathered_gate_up_swiglu (xla) against ops.gate_up_swiglu on permute(x): the act and
    the gradients of x (through its own backward: unpermute, gathered wgrad), w and the row
    weights (float32, 1e-5)."""
    s = _seed()
    x, rm, w, gs, rw, dact = _fused_case(s, jnp.float32, kind=kind)
    got = _fused_grads(lambda a, b, c: ops.gathered_gate_up_swiglu(a, rm, b, gs, c, backend="xla"),
                       x, w, rw, dact)
    want = _fused_grads(
        lambda a, b, c: ops.gate_up_swiglu(
            ops.permute(a, rm, backend="xla"), b, gs, c, backend="xla"), x, w, rw, dact)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(a, b) <= F32_TOL, f"seed={s} kind={kind}"


def test_gathered_gate_up_swiglu_errors(monkeypatch):
    x = jnp.zeros((8, 16), jnp.bfloat16)
    w = jnp.zeros((2, 16, 32), jnp.bfloat16)
    rm = jnp.zeros((10, ), jnp.int32)
    gs = jnp.array([5, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"row_weights must be \[R=10\], got \(8,\)"):
        ops.gathered_gate_up_swiglu(x, rm, w, gs, jnp.zeros((8, )))
    with pytest.raises(ValueError, match=r"w_gate_up .* are invalid; valid: \[E, K, 2H\]"):
        ops.gathered_gate_up_swiglu(x, rm, jnp.zeros((2, 16, 31), jnp.bfloat16), gs)
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    assert gu.gathered_unsupported(x, w, "silu", "cuda") == ""
    assert "silu" in gu.gathered_unsupported(x, w, "gelu", "cuda")
    with pytest.raises(ValueError, match="cannot run the CUDA kernels here: act='gelu'"):
        ops.gathered_gate_up_swiglu(x, rm, w, gs, act="gelu", backend="cuda")


# ---------------------------------------------------------------------------------- GPU


def _poison(nbytes: int = 1 << 30):
    """NaN-filled then freed device memory: outputs the kernel does not write show up as NaN."""
    a = jnp.full((nbytes // 4, ), jnp.nan, jnp.float32)
    a.block_until_ready()
    a.delete()


GPU_SHAPES = [  # (T, R, K, N, E): R not a multiple of any tile; K, N multiples of 8 only
    (500, 1000, 136, 200, 8),
    (1, 7, 64, 136, 5),
    (777, 6216, 256, 384, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [tiles.TILE_CONFIGS[t] for t in gm.GATHER_TILES])
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_against_float64(monkeypatch, kind, tile):
    _cuda_or_skip()
    monkeypatch.setenv(tiles.ENV_TILE, tile)
    for t, r, k, n, e in GPU_SHAPES:
        s = _seed()
        x, rm, ws, gs, douts = _case(t, r, k, (n, n + 8), e, kind, jnp.bfloat16, s)
        _poison()
        got = _run(x, rm, ws, gs, douts, "cuda")
        tag = f"seed={s} kind={kind} tile={tile} shape={(t, r, k, n, e)} sizes={np.asarray(gs)}"
        for a in jax.tree.leaves(got):
            assert np.isfinite(np.asarray(a, np.float32)).all(), tag
        _check(got, _loop(x, rm, ws, gs, douts), BF16_TOL, tag)
        total = int(np.asarray(gs).sum())
        assert not np.asarray(got[0][0][total:], np.float32).any(), tag
        again = _run(x, rm, ws, gs, douts, "cuda")  # deterministic: bitwise the same
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------ moe_block(gather_rows=True)

BLOCK_CASES = {
    "gated": dict(),
    "plain": dict(gated=False, activation="gelu"),
    "capacity_drops": dict(capacity_factor=0.5),
    "dswiglu_epilogue": dict(fuse_swiglu_bwd=True),
    "gather_combine": dict(gather_combine=True),
    "fused_gate_up": dict(fuse_gate_up=True),
}


def _block_grads(cfg, params, x, mesh=None, resources=None):
    cot = jax.random.normal(jax.random.key(7), x.shape, jnp.float32)

    def loss(p, a):
        o = mp.moe_block(p, a, cfg, mesh=mesh, resources=resources)
        return jnp.sum(o.y.astype(jnp.float32) * cot) + o.aux_loss, o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return o, g


# meshes: tensor parallelism (tp-varying weights), fsdp (weights gathered over a token axis) and
# expert parallelism (the experts read the exchanged rows by the regroup's order)
BLOCK_MESHES = {
    "dp4xtp2": ((4, 2), ("dp", "tp"), dict(dp="dp", tp="tp")),
    "fsdp4xtp2": ((4, 2), ("fsdp", "tp"), dict(fsdp="fsdp", tp="tp")),
    "dp2xfsdp2xep2": ((2, 2, 2), ("dp", "fsdp", "ep"), dict(dp="dp", fsdp="fsdp", ep="ep")),
    "ep2xtp2xdp2": ((2, 2, 2), ("ep", "tp", "dp"), dict(ep="ep", tp="tp", dp="dp")),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("mesh_name", [None, *BLOCK_MESHES])
def test_block_with_gather_rows_equals_the_permute_path(case, mesh_name):
    """Outputs, drops and every gradient equal the permute path's (float32, 1e-5)."""
    s = _seed()
    base = mp.MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, **BLOCK_CASES[case])
    params = mp.init_moe_params(jax.random.key(s), base)
    x = jax.random.normal(jax.random.key(s + 1), (4, 16, 16), jnp.float32)
    mesh = resources = None
    if mesh_name:
        shape, names, roles = BLOCK_MESHES[mesh_name]
        devs = np.array(jax.devices("cpu")[:8]).reshape(shape)
        mesh, resources = Mesh(devs, names), mp.MeshResources(**roles)
    got = _block_grads(dataclasses.replace(base, gather_rows=True), params, x, mesh, resources)
    want = _block_grads(base, params, x, mesh, resources)
    tag = f"seed={s} case={case} mesh={mesh_name}"
    assert rel_err(got[0].y, want[0].y) <= F32_TOL, tag
    assert int(got[0].dropped_tokens) == int(want[0].dropped_tokens), tag
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert rel_err(a, b) <= F32_TOL, tag


@pytest.mark.parametrize("gather_rows", [False, True])
def test_block_keeps_no_dispatched_rows(gather_rows):
    """What moe_block's backward keeps: with gather_rows no [T*k, M] array (the permuted copy
    of x and its 'moe_dispatched' name are gone); without it, the rows are kept."""
    cfg = mp.MoEConfig(num_experts=8, top_k=4, d_model=48, d_ff=24, gather_rows=gather_rows)
    params = mp.init_moe_params(jax.random.key(_seed()), cfg)
    x = jnp.ones((1, 32, 48), jnp.float32)
    res = saved_residuals(lambda p, a: jnp.sum(mp.moe_block(p, a, cfg).y), params, x)
    rows = [why for aval, why in res if tuple(aval.shape) == (128, 48)]
    assert bool(rows) != gather_rows, res


@pytest.mark.parametrize("fuse", [False, True])
def test_lowered_block_has_no_permute_of_x(monkeypatch, fuse):
    """moe_block fwd+bwd for CUDA on a faked Hopper with gather_rows: the gathered kernels and
    one indexed permute only (the combine's backward), against two with the permute path."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    texts = {}
    for flag in (False, True):
        cfg = mp.MoEConfig(num_experts=8,
                           top_k=2,
                           d_model=64,
                           d_ff=128,
                           kernel_backend="cuda",
                           gather_rows=flag,
                           fuse_gate_up=fuse)
        params = mp.init_moe_params(jax.random.key(_seed()), cfg)
        params = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
        x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)
        step = jax.value_and_grad(
            lambda p, a: jnp.sum(mp.moe_block(p, a, cfg).y.astype(jnp.float32)), argnums=(0, 1))
        texts[flag] = re.findall(r"custom_call @(moe_\w+)", cuda_module(jax.jit(step), params, x))
    on, off = texts[True], texts[False]
    fwd = "moe_grouped_gemm_gather_swiglu_fwd" if fuse else "moe_grouped_gemm_gather_fwd"
    n = 1 if fuse else 2  # one fused gate/up GEMM, or the two projections
    assert on.count(fwd) == n and on.count("moe_grouped_gemm_gather_wgrad") == n, on
    assert on.count("moe_permute_indexed") == 1 and off.count("moe_permute_indexed") == 2, (on, off)
    assert fwd not in off and "moe_grouped_gemm_gather_wgrad" not in off, off


@pytest.mark.parametrize("mesh_name", ["ep8", "dp2xfsdp2xep2"])
def test_lowered_expert_parallel_block_reads_the_exchanged_rows_by_index(monkeypatch, mesh_name):
    """The sharded block's fwd+bwd for CUDA on a faked Hopper with gather_rows under expert
    parallelism: the experts run the gathered kernels on the exchanged rows (two forwards, two
    wgrads), none of the plain forwards."""
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    cfg = mp.MoEConfig(d_model=16,
                       d_ff=32,
                       num_experts=8,
                       top_k=2,
                       kernel_backend="cuda",
                       gather_rows=True)
    fn, params, _, _ = sharded_block(cfg, mesh_name, "padded", "cuda")
    x, valid = jnp.ones((64, 16), jnp.bfloat16), jnp.ones((64, ), bool)
    grad = jax.value_and_grad(lambda p, a: jnp.sum(fn(p, a, valid)[0].astype(jnp.float32)**2),
                              argnums=(0, 1))
    targets = re.findall(r"custom_call @(moe_\w+)", cuda_module(jax.jit(grad), params, x))
    assert targets.count("moe_grouped_gemm_gather_fwd") == 2, targets
    assert targets.count("moe_grouped_gemm_gather_wgrad") == 2, targets
    assert targets.count("moe_grouped_gemm_fwd") == 1, targets  # the down projection only


def test_gather_rows_config_errors_and_the_sm80_fallback(monkeypatch):
    for bad in (dict(fuse_gate_up=True, fuse_swiglu_bwd=True), dict(fp8="blockwise")):
        with pytest.raises(ValueError,
                           match=r"MoEConfig.gather_rows=True is invalid: needs "
                           r"fp8=None, not fuse_gate_up with fuse_swiglu_bwd"):
            mp.MoEConfig(num_experts=4, top_k=1, d_model=128, d_ff=128, gather_rows=True, **bad)
    cfg = mp.MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, gather_rows=True)
    x = jnp.zeros((4, 8), jnp.bfloat16)
    weights = mp.init_moe_params(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match="one of them"):
        experts.expert_ffn(None, jnp.zeros(4, jnp.int32), weights, cfg)
    assert gathered.gathers_rows(cfg, x, weights, "xla")
    _fake_device(monkeypatch, 90, name="NVIDIA H200")
    monkeypatch.setenv(ops.backend.ENV_GROUPED_GEMM, "sm80")
    with pytest.warns(RuntimeWarning, match="gather_rows=True is not honoured here: .*sm80"):
        assert not gathered.gathers_rows(cfg, x, weights, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [{}, dict(capacity_factor=0.75),
     dict(fuse_swiglu_bwd=True),
     dict(fuse_gate_up=True)])
def test_block_on_gpu_with_gather_rows_equals_the_permute_path(extra):
    """bf16 moe_block on the GPU, gather_rows against the permute path (both 'cuda'): outputs,
    drops and every gradient (bf16 tolerance; the GEMMs see the same bf16 operands)."""
    _cuda_or_skip()
    s = _seed()
    base = mp.MoEConfig(num_experts=16,
                        top_k=4,
                        d_model=256,
                        d_ff=384,
                        kernel_backend="cuda",
                        **extra)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                          mp.init_moe_params(jax.random.key(s), base))
    x = jax.random.normal(jax.random.key(s + 1), (2, 333, 256), jnp.float32).astype(jnp.bfloat16)
    got = _block_grads(dataclasses.replace(base, gather_rows=True), params, x)
    want = _block_grads(base, params, x)
    tag = f"seed={s} extra={extra}"
    assert int(got[0].dropped_tokens) == int(want[0].dropped_tokens), tag
    assert rel_err(got[0].y, want[0].y) <= BF16_TOL, tag
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert np.isfinite(np.asarray(a, np.float32)).all(), tag
        assert rel_err(a, b) <= BF16_TOL, tag


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [tiles.TILE_CONFIGS[t] for t in gm.GATHER_TILES])
@pytest.mark.parametrize("kind", KINDS)
def test_gathered_fused_kernel_equals_the_fused_kernel_on_permuted_rows(monkeypatch, kind, tile):
    """The gathered fused forward (and its backward) against the fused kernel on the permuted
    rows, same tile: act, dx, dw and the row weights' gradient (bf16, 1e-2), outputs poisoned."""
    _cuda_or_skip()
    monkeypatch.setenv(tiles.ENV_TILE, tile)
    for t, r, k, n, e in GPU_SHAPES:
        s = _seed()
        x, rm, w, gs, rw, dact = _fused_case(s, jnp.bfloat16, t, r, k, n, e, kind)
        _poison()
        got = _fused_grads(
            lambda a, b, c: ops.gathered_gate_up_swiglu(a, rm, b, gs, c, backend="cuda"), x, w, rw,
            dact)
        want = _fused_grads(
            lambda a, b, c: ops.gate_up_swiglu(
                ops.permute(a, rm, backend="cuda"), b, gs, c, backend="cuda"), x, w, rw, dact)
        tag = f"seed={s} kind={kind} tile={tile} shape={(t, r, k, n, e)}"
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.isfinite(np.asarray(a, np.float32)).all(), tag
            assert rel_err(a, b) <= BF16_TOL, tag
