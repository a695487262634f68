"""ops.grouped_gemm's CUDA (CUTLASS) kernels on the GPU (the `gpu` marker): forward and gradients
of every compiled tile (and raster, swizzle and row-split variants) on every group-size pattern,
the adaptive tile pair's choice on the device against its cost model, new group sizes without
recompiling, the op inside shard_map over an 'ep' axis, the fallback for unsupported problems, the
whole moe_block, and the kernels captured into CUDA graphs (a child process).

bf16 inputs against the float64 loop on the same bf16 values (tests/grouped_gemm_util.py):
1e-2 norm-wise -- fp32 accumulation, then one bf16 rounding of the output (<= 2^-9 ~ 2e-3
relative). Inputs are fresh random draws every run (the seed is printed on failure).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import moe_praxis as mp
from moe_praxis import ops
from tests.grouped_gemm_util import (GPU_SHAPES, KINDS, _COMMAND_BUFFER_SCRIPT, _cuda_or_skip,
                                     check_in_command_buffers, _inputs, adaptive_model, gg,
                                     loop_grads, loop_reference, make_sizes)
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RTOL_BF16 = 1e-2


def _uses_kernel(fn, *args, target="moe_grouped_gemm_fwd"):
    return target in jax.jit(fn).lower(*args).as_text()


# Every compiled tile, and the other raster order and a swizzle once; row splits of 256 rows
# (several pieces per group at these M; wgrad ignores them) for the wide, thin and adaptive tiles.
GPU_CONFIGS = list(gg.TILE_CONFIGS) + [
    gg.TILE_CONFIGS[0] + "/along_n/s2",
    gg.TILE_CONFIGS[2] + "/along_m/s1/r256",
    gg.TILE_CONFIGS[3] + "/along_n/s1/r256",
    gg.TILE_CONFIGS[gg.ADAPTIVE_TILE] + "/along_m/s1/r512",
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", GPU_CONFIGS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_forward_matches_reference(kind, tile):
    _cuda_or_skip()
    for m, k, n, e in GPU_SHAPES:
        seed = _seed()
        lhs, rhs, gs, _ = _inputs(m, k, n, e, kind, jnp.bfloat16, seed)
        f = lambda a, b, g: ops.grouped_gemm(a, b, g, backend="cuda", config=tile)  # noqa: E731
        assert _uses_kernel(f, lhs, rhs, gs)
        out = jax.jit(f)(lhs, rhs, gs)
        msg = f"seed={seed} kind={kind} tile={tile} shape={(m, k, n, e)} sizes={np.asarray(gs)}"
        assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
        assert np.isfinite(np.asarray(out, np.float32)).all(), msg
        assert rel_err(out, loop_reference(lhs, rhs, gs)) < RTOL_BF16, msg
        total = int(np.asarray(gs).sum())
        np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0, err_msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", GPU_CONFIGS)
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_groups", "one_row", "sum_lt_m"])
def test_cuda_grads_match_reference(kind, tile):
    _cuda_or_skip()
    m, k, n, e = 1000, 136, 200, 8
    seed = _seed()
    lhs, rhs, gs, dout = _inputs(m, k, n, e, kind, jnp.bfloat16, seed)
    msg = f"seed={seed} kind={kind} tile={tile} sizes={np.asarray(gs)}"

    def f(a, b):
        return ops.grouped_gemm(a, b, gs, backend="cuda", config=tile)

    grads = jax.jit(lambda a, b, d: jax.vjp(f, a, b)[1](d))
    # Poison: run on other data first so stale memory would show in empty experts / tail rows.
    jax.block_until_ready(grads(lhs * 3 + 1, rhs * 2 + 1, dout + 1))
    dlhs, drhs = grads(lhs, rhs, dout)
    ref_dlhs, ref_drhs = loop_grads(lhs, rhs, gs, dout)
    assert rel_err(dlhs, ref_dlhs) < RTOL_BF16, msg
    assert rel_err(drhs, ref_drhs) < RTOL_BF16, msg
    empty = np.asarray(gs) == 0
    np.testing.assert_array_equal(np.asarray(drhs, np.float32)[empty], 0.0, err_msg=msg)
    total = int(np.asarray(gs).sum())
    np.testing.assert_array_equal(np.asarray(dlhs[total:], np.float32), 0.0, err_msg=msg)
    text = grads.lower(lhs, rhs, dout).as_text()
    assert "moe_grouped_gemm_dgrad" in text and "moe_grouped_gemm_wgrad" in text


@pytest.mark.gpu
@pytest.mark.parametrize("tile", gg.ADAPTIVE_TILES)
def test_cuda_adaptive_tile_choice_matches_model_and_both_kernels_are_right(tile):
    """The device picks 128x256 or 64x256 from the group sizes at each call: its choice (read
    from the workspace) equals the Python cost model (with the pair's cluster rounding), both
    choices occur, and the output and gradients are right whichever ran (poisoned outputs
    before each call)."""
    _cuda_or_skip()
    sm = jax.devices()[0].core_count
    cfg = gg.TILE_CONFIGS[tile]
    split_cfg = cfg + "/along_m/s1/r256"  # pieces of 256 rows: the same tiles, the same choice
    m, k, n, e = 4096, 128, 2048, 64
    fwd = jax.jit(lambda a, b, g: gg.run_kernel("fwd", (m, n), a, b, g, cfg, with_workspace=True))
    dgrad = jax.jit(
        lambda d, b, g: gg.run_kernel("dgrad", (m, k), d, b, g, cfg, with_workspace=True))
    fwd_split = jax.jit(
        lambda a, b, g: gg.run_kernel("fwd", (m, n), a, b, g, split_cfg, with_workspace=True))
    problems = gg.num_problems(e, m, 256)
    rng = np.random.default_rng(_seed())
    patterns = {
        "64 rows each": np.full(e, 64),  # 128-row tiles half empty: 64x256 must win
        "one group": np.eye(e, dtype=np.int64)[3] * m,  # full tiles: 128x256
        "skewed": make_sizes("skewed", m, e, rng),
        "random": make_sizes("random", m, e, rng),
        "one_row": make_sizes("one_row", m, e, rng),
    }
    seen = set()
    for name, sizes in patterns.items():
        seed = _seed()
        lhs, rhs, _, dout = _inputs(m, k, n, e, "balanced", jnp.bfloat16, seed)
        gs = jnp.asarray(sizes, jnp.int32)
        msg = f"seed={seed} {name} sizes={sizes}"
        jax.block_until_ready(fwd(lhs + 1, rhs * 3, gs))  # poison the buffers
        out, ws = fwd(lhs, rhs, gs)
        choice = int(gg.adaptive_choice(ws, e))
        assert choice == adaptive_model(sizes, n, sm, tile, "fwd"), msg
        seen.add(choice)
        assert rel_err(out, loop_reference(lhs, rhs, gs)) < RTOL_BF16, msg
        np.testing.assert_array_equal(np.asarray(out[int(sizes.sum()):], np.float32), 0.0, msg)
        jax.block_until_ready(fwd_split(lhs * 2, rhs + 1, gs))  # poison
        out_s, ws_s = fwd_split(lhs, rhs, gs)
        assert int(gg.adaptive_choice(ws_s, problems)) == choice, msg
        np.testing.assert_array_equal(np.asarray(out_s, np.float32),
                                      np.asarray(out, np.float32),
                                      err_msg=msg)  # same tiles, same accumulation order
        dl, ws_d = dgrad(dout, rhs, gs)
        assert int(gg.adaptive_choice(ws_d, e)) == adaptive_model(sizes, k, sm, tile, "dgrad"), msg
        ref_dl, _ = loop_grads(lhs, rhs, gs, dout)
        assert rel_err(dl, ref_dl) < RTOL_BF16, msg
    assert seen == {0, 1}, f"both kernels of the pair must have run: {seen}"


@pytest.mark.gpu
def test_cuda_group_sizes_change_without_recompiling():
    _cuda_or_skip()
    m, k, n, e = 1024, 128, 256, 8
    f = jax.jit(lambda a, b, g: ops.grouped_gemm(a, b, g, backend="cuda"))
    for kind in KINDS:
        seed = _seed()
        lhs, rhs, gs, _ = _inputs(m, k, n, e, kind, jnp.bfloat16, seed)
        out = f(lhs, rhs, gs)
        assert rel_err(out, loop_reference(lhs, rhs, gs)) < RTOL_BF16, f"seed={seed} {kind}"
    assert f._cache_size() == 1


@pytest.mark.gpu
def test_cuda_inside_jit_shard_map_ep_like():
    """The op under jit inside shard_map over an 'ep' axis (local experts per shard)."""
    _cuda_or_skip()
    devs = jax.devices("gpu")
    mesh = Mesh(np.array(devs), ("ep", ))
    ep = len(devs)
    m, k, n, e_local = 512, 128, 256, 4
    seed = _seed()
    lhs, rhs, _, dout = _inputs(m * ep, k, n, e_local * ep, "balanced", jnp.bfloat16, seed)
    rng = np.random.default_rng(seed)
    gs = np.concatenate([make_sizes("skewed", m, e_local, rng) for _ in range(ep)])

    def local(a, b, g, d):
        out, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, g, backend="cuda"), a, b)
        return (out, *vjp(d))

    f = jax.jit(
        jax.shard_map(local,
                      mesh=mesh,
                      in_specs=(P("ep"), P("ep"), P("ep"), P("ep")),
                      out_specs=(P("ep"), P("ep"), P("ep"))))
    out, dlhs, drhs = f(lhs, rhs, jnp.asarray(gs), dout)
    for r in range(ep):
        rows = slice(r * m, (r + 1) * m)
        ex = slice(r * e_local, (r + 1) * e_local)
        ref = loop_reference(lhs[rows], rhs[ex], gs[ex])
        ref_dlhs, ref_drhs = loop_grads(lhs[rows], rhs[ex], gs[ex], dout[rows])
        assert rel_err(out[rows], ref) < RTOL_BF16, f"seed={seed} rank={r}"
        assert rel_err(dlhs[rows], ref_dlhs) < RTOL_BF16, f"seed={seed} rank={r}"
        assert rel_err(drhs[ex], ref_drhs) < RTOL_BF16, f"seed={seed} rank={r}"


@pytest.mark.gpu
def test_cuda_unsupported_problem_falls_back_with_warning():
    _cuda_or_skip()
    lhs = jnp.ones((16, 12), jnp.bfloat16)  # K = 12 is not a multiple of 8
    rhs = jnp.ones((2, 12, 16), jnp.bfloat16)
    ops.backend.reset_warnings()
    with pytest.warns(UserWarning, match="K and N multiples of 8"):
        out = ops.grouped_gemm(lhs, rhs, jnp.array([8, 8]), backend="cuda")
    np.testing.assert_allclose(np.asarray(out, np.float32), 12.0)


@pytest.mark.gpu
def test_moe_block_cuda_matches_xla():
    """moe_block with kernel_backend='cuda' runs the grouped GEMM kernels (bf16)."""
    _cuda_or_skip()
    cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=128, d_ff=256)
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (4, 96, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cuda_cfg = dataclasses.replace(cfg, kernel_backend="cuda")
    xla_cfg = dataclasses.replace(cfg, kernel_backend="xla")
    f = jax.jit(lambda p, x: mp.moe_block(p, x, cuda_cfg).y)
    assert "moe_grouped_gemm_fwd" in f.lower(params, x).as_text()
    y = f(params, x)
    y_ref = jax.jit(lambda p, x: mp.moe_block(p, x, xla_cfg).y)(params, x)
    assert rel_err(y, y_ref) < 2e-2, f"seed={seed}"


@pytest.mark.gpu
def test_cuda_kernels_inside_cuda_graphs():
    """Every kernel declares XLA's command-buffer trait: group sizes are read on the device,
    so a captured graph is correct with any sizes. `ops.backend.call_stats()` counts the grouped
    GEMM handler calls made while XLA captured their stream into a CUDA graph. A fresh process
    with command buffers forced on for custom calls (min graph size 1) runs the grouped GEMM
    fwd/dgrad/wgrad with seven group-size patterns through ONE executable, and the moe_block (router, aux loss,
    permute, SwiGLU, grouped GEMM) loss and gradients against the XLA path."""
    _cuda_or_skip()
    check_in_command_buffers(_COMMAND_BUFFER_SCRIPT, _seed(), RTOL_BF16)
