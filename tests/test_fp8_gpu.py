"""FP8 grouped GEMM kernels (moe_praxis.ops.fp8.gemm) and the CUDA path of ops.fp8.

CPU tests (no marker): the wrappers' named errors, the backend requirement, and the CUDA path of
fp8.fp8_grouped_gemm lowered for the CPU (each kernel call becomes its reference) against
independent float64 loops. GPU tests (`gpu` marker, skipped without a usable H100/H200): each
kernel against its reference on the SAME quantized operands and against bf16; gradients; the
MoE block.

Tolerances (norm-wise relative error ||got - want|| / ||want||):
- kernel vs a float64 loop over the same dequantized operands, bf16 output: 5e-3. The kernel
  accumulates exact e4m3 products in float32 (per 128 of K, then scaled), so the float32 error
  is ~1e-6; one bf16 rounding of the output is at most 2^-9 relative per element (~2e-3).
- kernel with float32 output (wgrad_f32) vs float32 / float64 references: 5e-4. Hopper's FP8
  tensor cores accumulate each 128-deep K block with about 14 mantissa bits, not float32's 24
  (which is why the recipe promotes to float32 registers every 128 of K): each block's partial
  sum is off by up to ~2^-13 relative; measured ~1e-4 norm-wise.
- the CUDA path's references on the CPU vs float64: 1e-5 (float32 summation order only).
- kernel vs the bf16 grouped GEMM of the unquantized inputs: 0.08, the e4m3 bound of
  tests/test_fp8.py (each operand off by up to 2^-4 relative; norm-wise ~0.05).
- the CUDA path's gradients vs the pure-JAX recipe (the same quantized operands): dlhs 1e-2
  (both round to bf16 twice); dw 5e-4 (float32 out, the kernel's FP8 accumulation above).
Inputs are fresh random draws (the seed is in every failure message).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops import backend
from moe_praxis.ops.fp8 import recipe as fp8, gemm as fp8_gemm
from moe_praxis.ops.fp8.rule import Fp8Gemms
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference
from tests.grouped_gemm_util import make_sizes
from tests.testutil import rel_err
from tests.testutil import seed as _seed

TOL_BF16_OUT = 5e-3
TOL_F32_OUT = 1e-5  # float32 references against float64
TOL_F32_KERNEL = 5e-4  # the FP8 tensor cores' accumulation within a 128-deep K block
FP8_BOUND = 0.08
KINDS = ["balanced", "skewed", "one_takes_all", "empty_groups", "one_row", "sum_lt_m"]
# (R, C, N, E): R not a tile multiple; the two GEMMs of test_moe_block_fp8_cuda_matches_...
NT_SHAPES = [(1000, 256, 384, 8), (333, 128, 128, 3), (1024, 256, 512, 8), (1024, 512, 256, 8)]


def _sizes(kind, rows, e, rng):
    return jnp.asarray(make_sizes(kind, rows, e, rng))


def _nt_operands(rows, c, n, e, kind, seed):
    """x [R, C] bf16, w [E, C, N] f32, sizes, and the kernel's operands (L1 of x, L2 of w)."""
    rng = np.random.default_rng(seed)
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (rows, c), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (e, c, n), jnp.float32) / np.sqrt(c)
    gs = _sizes(kind, rows, e, rng)
    q, s = fp8.quantize_tiles(x, axis=1)
    wq, ws = fp8.quantize_blocks(w)
    return x, w, gs, (q, s.T, jnp.swapaxes(wq, 1, 2), ws, gs)


def _loop_nt(a, a_s, b, b_s, gs):
    """float64 loop over groups of the dequantized operands."""
    a = np.asarray(fp8_gemm.dequantize_rows(a, a_s), np.float64)
    b = np.asarray(fp8_gemm.dequantize_blocks_nk(b, b_s), np.float64)
    out, start = np.zeros((a.shape[0], b.shape[1])), 0
    for g, m in enumerate(np.asarray(gs)):
        out[start:start + m] = a[start:start + m] @ b[g].T
        start += m
    return out


def _wgrad_operands(rows, c1, c2, e, kind, seed):
    rng = np.random.default_rng(seed)
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (rows, c1), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(k2, (rows, c2), jnp.float32).astype(jnp.bfloat16)
    gs = _sizes(kind, rows, e, rng)
    xt, xs = fp8.quantize_rows_grouped_t_reference(x, gs)
    dyt, dys = fp8.quantize_rows_grouped_t_reference(dy, gs)
    return x, dy, gs, (xt, xs, dyt, dys, gs)


def _loop_wgrad_groupwise(x, dy, gs):
    """float64 wgrad of the per-group recipe, from scratch: each group's rows quantized in
    128-row tiles starting at its first row (numpy), then x_g^T dy_g."""

    def deq(t):
        t = np.asarray(t, np.float32)
        pad = -t.shape[0] % 128
        t = np.concatenate([t, np.zeros((pad, t.shape[1]), np.float32)])
        out = np.zeros_like(t, np.float64)
        for r0 in range(0, t.shape[0], 128):
            tile = t[r0:r0 + 128]
            amax = np.abs(tile).max(0)
            s = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
            q = np.asarray(jnp.asarray(tile / s).astype(jnp.float8_e4m3fn), np.float64)
            out[r0:r0 + 128] = q * s
        return out[:t.shape[0] - pad]

    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    out, start = np.zeros((len(gs), x.shape[1], dy.shape[1])), 0
    for g, m in enumerate(np.asarray(gs)):
        if m:
            out[g] = deq(x[start:start + m]).T @ deq(dy[start:start + m])
        start += m
    return out


# ------------------------------------------------------------------------------------ CPU


def test_wrappers_name_bad_operands():
    _, _, _, (a, a_s, b, b_s, gs) = _nt_operands(256, 256, 128, 2, "balanced", 0)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn, got bfloat16"):
        fp8_gemm.fp8_nt(a.astype(jnp.bfloat16), a_s, b, b_s, gs)
    with pytest.raises(ValueError, match=r"a_scales must be \[C/128, R\] = \(2, 256\)"):
        fp8_gemm.fp8_nt(a, a_s.T, b, b_s, gs)
    with pytest.raises(ValueError, match=r"b_scales must be \[E, C/128, N/128\]"):
        fp8_gemm.fp8_nt(a, a_s, b, jnp.swapaxes(b_s, 1, 2)[:, :1], gs)
    with pytest.raises(ValueError, match="C and N multiples of 128; got C=256, N=64"):
        fp8_gemm.fp8_nt(a, a_s, b[:, :64], b_s, gs)
    with pytest.raises(ValueError, match=r"group_sizes must be \[E=2\]"):
        fp8_gemm.fp8_nt(a, a_s, b, b_s, gs[:1])
    with pytest.raises(ValueError, match="tile=7 is invalid; valid: 0...5"):
        fp8_gemm.fp8_nt(a, a_s, b, b_s, gs, tile=7)
    with pytest.raises(ValueError, match="swizzle=3 is invalid"):
        fp8_gemm.fp8_nt(a, a_s, b, b_s, gs, swizzle=3)
    _, _, gs, (xt, xs, dyt, dys, _) = _wgrad_operands(200, 128, 256, 3, "balanced", 0)
    with pytest.raises(ValueError, match=r"Rp = padded_rows\(rows=100, E=3\) = 512"):
        fp8_gemm.fp8_wgrad(xt, xs, dyt, dys, gs, 100)
    with pytest.raises(ValueError, match="out_dtype=float16 is invalid"):
        fp8_gemm.fp8_wgrad(xt, xs, dyt, dys, gs, 200, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"dy_scales must be \[Rp/128, C2\]"):
        fp8_gemm.fp8_wgrad(xt, xs, dyt, xs, gs, 200)


def test_fp8_kernels_need_compute_capability_9_0_in_one_place():
    assert backend.COMPUTE_CAPABILITY[fp8_gemm.OP] == (90, 91)
    for target in fp8_gemm.TARGETS.values():
        assert backend.KERNELS[target].startswith("MoeGroupedGemmFp8"), target
    assert fp8_gemm.workspace_bytes(3) == 1280 + fp8_gemm.CUTLASS_WORKSPACE_BYTES


@pytest.mark.parametrize("kind", ["skewed", "empty_groups", "one_row", "sum_lt_m"])
def test_cuda_path_lowered_for_cpu_matches_float64_recipe(kind):
    """The CUDA path's own layouts and calls, run through the kernels' references: forward
    and dgrad equal the recipe's pure-JAX path to bf16 rounding, wgrad the per-group recipe
    (float64 from scratch). Pinned to the CPU: on a GPU host the same calls reach the real
    kernels, whose FP8 accumulation is the GPU tests' business (TOL_F32_KERNEL)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _cuda_path_lowered_for_cpu(kind)


def _cuda_path_lowered_for_cpu(kind):
    seed = _seed()
    rows, c, n, e = 400, 256, 128, 5
    x, w, gs, _ = _nt_operands(rows, c, n, e, kind, seed)
    dy = jax.random.normal(jax.random.key(seed + 1), (rows, n), jnp.float32).astype(jnp.bfloat16)
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"

    def run(impl):
        y, vjp = jax.vjp(lambda a, b: fp8.fp8_grouped_gemm_path(a, b, gs, impl), x, w)
        return (y, *vjp(dy))

    (y, dx, dw), (y_ref, dx_ref, _) = run("cuda"), run("xla")
    assert y.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert rel_err(y, y_ref) < TOL_BF16_OUT, msg
    assert rel_err(dx, dx_ref) < 1e-2, msg
    total = int(np.asarray(gs).sum())
    np.testing.assert_array_equal(np.asarray(y[total:], np.float32), 0.0, err_msg=msg)
    want = _loop_wgrad_groupwise(x, dy, gs)
    assert rel_err(dw, want) < TOL_F32_OUT, msg


# ------------------------------------------------------------------------------------ GPU


def _cuda_or_skip():
    ok, why = backend.cuda_status(fp8_gemm.OP)
    if not ok:
        pytest.skip(f"FP8 grouped GEMM kernels not usable: {why}")


def _lowered(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.gpu
def test_pure_jax_recipe_on_gpu_really_rounds_to_e4m3():
    """Quantize and dequantize inside one jit on the GPU equal the CPU's (XLA:GPU folds
    f32 -> e4m3 -> f32 conversion chains away unless the e4m3 value is kept), and the
    recipe's 'xla' path on the GPU equals the same path on the CPU."""
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (256, 512), jnp.float32)
    cpu = jax.devices("cpu")[0]

    def roundtrip(v):
        return fp8.dequantize_tiles(*fp8.quantize_tiles(v, axis=1), axis=1)

    got = jax.jit(roundtrip)(x)
    want = jax.jit(roundtrip)(jax.device_put(x, cpu))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed={seed}")
    assert rel_err(got, x) > 0.005, f"seed={seed}: nothing was quantized"
    rows, c, n, e = 512, 256, 256, 4
    x, w, gs, _ = _nt_operands(rows, c, n, e, "skewed", seed)
    f = jax.jit(lambda a, b, g: fp8.fp8_grouped_gemm(a, b, g, backend="xla"))
    y_gpu, y_cpu = f(x, w, gs), f(*jax.device_put((x, w, gs), cpu))
    assert rel_err(y_gpu, y_cpu) < TOL_BF16_OUT, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", range(len(fp8_gemm.TILE_CONFIGS)))
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_nt_matches_reference_and_bf16(kind, tile):
    _cuda_or_skip()
    for rows, c, n, e in NT_SHAPES:
        seed = _seed()
        x, w, gs, ops_ = _nt_operands(rows, c, n, e, kind, seed)
        msg = f"seed={seed} kind={kind} tile={tile} shape={(rows, c, n, e)} sizes={np.asarray(gs)}"
        f = jax.jit(lambda *a: fp8_gemm.fp8_nt(*a, tile=tile))
        assert fp8_gemm.TARGETS["nt"] in _lowered(f, *ops_)
        # poison: a first call whose rows are all NaN (e4m3 NaN in a) over every row
        nan_a = jnp.full_like(ops_[0], jnp.nan)
        full = jnp.zeros_like(gs).at[0].set(rows)
        jax.block_until_ready(f(nan_a, *ops_[1:4], full))
        out = f(*ops_)
        assert out.dtype == jnp.bfloat16 and out.shape == (rows, n)
        assert np.isfinite(np.asarray(out, np.float32)).all(), msg
        assert rel_err(out, _loop_nt(*ops_)) < TOL_BF16_OUT, msg
        assert rel_err(out, fp8_gemm.fp8_nt_reference(*ops_)) < TOL_BF16_OUT, msg
        total = int(np.asarray(gs).sum())
        np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0, err_msg=msg)
        bf16 = ops.grouped_gemm(x, w.astype(jnp.bfloat16), gs, backend="cuda")
        if total:
            assert rel_err(out[:total], bf16[:total]) < FP8_BOUND, msg


@pytest.mark.gpu
@pytest.mark.parametrize("tile", range(len(fp8_gemm.TILE_CONFIGS)))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_wgrad_matches_reference_and_bf16(kind, out_dtype, tile):
    _cuda_or_skip()
    rows, c1, c2, e = 1000, 256, 384, 8
    seed = _seed()
    x, dy, gs, ops_ = _wgrad_operands(rows, c1, c2, e, kind, seed)
    msg = f"seed={seed} kind={kind} out={jnp.dtype(out_dtype)} tile={tile} sizes={np.asarray(gs)}"
    f = jax.jit(lambda *a: fp8_gemm.fp8_wgrad(*a, rows, out_dtype=out_dtype, tile=tile))
    assert fp8_gemm.TARGETS["wgrad_f32" if out_dtype == jnp.float32 else "wgrad"] in _lowered(
        f, *ops_)
    nan_x = jnp.full_like(ops_[0], jnp.nan)  # poison every expert's output first
    full = jnp.full_like(gs, rows // e)
    jax.block_until_ready(f(nan_x, *ops_[1:4], full))
    out = f(*ops_)
    assert out.dtype == out_dtype and out.shape == (e, c1, c2)
    assert np.isfinite(np.asarray(out, np.float32)).all(), msg
    tol = TOL_F32_KERNEL if out_dtype == jnp.float32 else TOL_BF16_OUT
    assert rel_err(out, _loop_wgrad_groupwise(x, dy, gs)) < tol, msg
    # the reference on the CPU: float32 products there are exact (no TF32 question)
    ref = fp8_gemm.fp8_wgrad_reference(*jax.device_put(ops_,
                                                       jax.devices("cpu")[0]), rows, out_dtype)
    assert rel_err(out, ref) < tol, msg
    for g in np.flatnonzero(np.asarray(gs) == 0):
        np.testing.assert_array_equal(np.asarray(out[g], np.float32), 0.0, err_msg=msg)
    bf16 = grouped_gemm_wgrad_reference(x.astype(jnp.float32), dy.astype(jnp.float32), gs)
    assert rel_err(out, bf16) < FP8_BOUND, msg


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_groups", "one_row", "sum_lt_m"])
def test_cuda_fp8_grouped_gemm_grads_match_pure_jax_paths(kind):
    """fp8_grouped_gemm(backend='cuda') on the GPU against (a) the same CUDA path lowered for
    the CPU (the kernels' references: tight) and (b) the recipe's pure-JAX path on the CPU
    (module doc)."""
    _cuda_or_skip()
    rows, c, n, e = 1000, 256, 384, 8
    seed = _seed()
    x, w, gs, _ = _nt_operands(rows, c, n, e, kind, seed)
    dy = jax.random.normal(jax.random.key(seed + 1), (rows, n), jnp.float32).astype(jnp.bfloat16)
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"

    def run(backend_, device=None):
        args = (x, w, gs, dy) if device is None else jax.device_put((x, w, gs, dy), device)

        def f(a, b, g, d):
            y, vjp = jax.vjp(lambda a, b: fp8.fp8_grouped_gemm(a, b, g, backend=backend_), a, b)
            return (y, *vjp(d))

        if device is None and backend_ == "cuda":
            assert fp8_gemm.TARGETS["wgrad_f32"] in _lowered(f, *args)
        return jax.jit(f)(*args)

    got = run("cuda")
    same_path = run("cuda", jax.devices("cpu")[0])
    recipe = run("xla", jax.devices("cpu")[0])
    for name, a, b, c_ in zip(("y", "dx", "dw"), got, same_path, recipe):
        assert rel_err(a, b) < (TOL_F32_KERNEL if name == "dw" else TOL_BF16_OUT), (name, msg)
        assert rel_err(a, c_) < (TOL_F32_KERNEL if name == "dw" else 1e-2), (name, msg)


def _block_step(cfg, params, x):
    """(the jitted value_and_grad of sum(moe_block(p, x).y * sin(x)) w.r.t. (params, x), with y
    as aux; its value at (params, x))."""

    def loss(p, xx):
        o = mp.moe_block(p, xx, cfg)
        return jnp.sum(o.y.astype(jnp.float32) * jnp.sin(xx.astype(jnp.float32))), o.y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return fn, fn(params, x)


@pytest.mark.gpu
def test_moe_block_fp8_cuda_matches_reference_path():
    """moe_block with fp8='blockwise' on kernel_backend='cuda' runs the FP8 kernels (no
    emulation warning), its permute and SwiGLU writing FP8 operands, and agrees with the
    pure-JAX FP8 path. fp8_gemms='all': every GEMM in FP8 (at these widths 'auto' keeps the
    dgrads and wgrads in bf16: the next test)."""
    _cuda_or_skip()
    cfg = mp.MoEConfig(num_experts=8,
                       top_k=2,
                       d_model=256,
                       d_ff=512,
                       fp8="blockwise",
                       fp8_gemms="all")
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (4, 128, cfg.d_model), jnp.float32).astype(jnp.bfloat16)

    def run(kernel_backend):
        return _block_step(dataclasses.replace(cfg, kernel_backend=kernel_backend), params, x)

    backend.reset_warnings()
    fn, ((_, y), grads) = run("cuda")
    hlo = fn.lower(params, x).as_text()
    assert fp8_gemm.TARGETS["nt"] in hlo and fp8_gemm.TARGETS["wgrad_f32"] in hlo
    # the permute and the SwiGLU write the GEMMs' FP8 operands (experts._fp8_kernel_ffn)
    assert "moe_permute_fp8" in hlo and "moe_swiglu_fwd_fp8" in hlo
    (_, y_ref), grads_ref = run("xla")[1]
    y_bf16 = jax.jit(lambda p, xx: mp.moe_block(
        p, xx, dataclasses.replace(cfg, fp8=None, kernel_backend="cuda")).y)(params, x)
    assert rel_err(y, y_bf16) < FP8_BOUND, f"seed={seed}"
    assert rel_err(y_ref, y_bf16) < FP8_BOUND, f"seed={seed}"
    assert rel_err(y, y_ref) < 2e-2, f"seed={seed}"
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert rel_err(a, b) < FP8_BOUND, f"seed={seed}"


@pytest.mark.gpu
def test_moe_block_fp8_auto_mixes_kernels_and_matches_the_reference_path():
    """fp8_gemms='auto' (the default) at d_model 4096, d_ff 256: the rule runs every forward and
    wi_gate / wi_up's dgrad (K = 4096) in FP8 and the other GEMMs in bf16 on the master weight;
    the CUDA kernels' HLO has the FP8 forward and no FP8 wgrad, and output and gradients agree
    with the pure-JAX path of the same choices and with the bf16 block."""
    _cuda_or_skip()
    cfg = mp.MoEConfig(num_experts=4, top_k=2, d_model=4096, d_ff=256, fp8="blockwise")
    wi, wo = Fp8Gemms(True, True, False), Fp8Gemms(True, False, False)  # rule: test_fp8_rule
    assert cfg.fp8_choices() == {"wi_gate": wi, "wi_up": wi, "wo": wo}
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    # 4096 tokens, top-2 of 4: 2048 rows per expert, where the weights' FP8 form pays
    x = jax.random.normal(k2, (2, 2048, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    out = jax.eval_shape(lambda p, xx: mp.moe_block(p, xx, cfg), params, x)
    assert dict(out.fp8_gemms) == cfg.fp8_choices()

    def run(c):
        return _block_step(c, params, x)

    fn, ((_, y), grads) = run(dataclasses.replace(cfg, kernel_backend="cuda"))
    hlo = fn.lower(params, x).as_text()
    assert fp8_gemm.TARGETS["nt"] in hlo
    assert fp8_gemm.TARGETS["wgrad_f32"] not in hlo and fp8_gemm.TARGETS["wgrad"] not in hlo
    (_, y_ref), grads_ref = run(dataclasses.replace(cfg, kernel_backend="xla"))[1]
    (_, y_bf16), grads_bf16 = run(dataclasses.replace(cfg, fp8=None, kernel_backend="cuda"))[1]
    msg = f"seed={seed}"
    assert rel_err(y, y_ref) < 2e-2, msg
    assert rel_err(y, y_bf16) < FP8_BOUND and rel_err(y, y_bf16) > 1e-3, msg
    for a, b, c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref),
                       jax.tree.leaves(grads_bf16)):
        assert rel_err(a, b) < FP8_BOUND and rel_err(a, c) < FP8_BOUND, msg


# The cooperative 128x128x128 tiles differ in cluster shape and in whether each K block's scale
# promotion overlaps the next block's wgmmas; each output element is accumulated in the same
# order in all of them, so they must agree bit for bit.
COOP_TILES = [
    i for i, name in enumerate(fp8_gemm.TILE_CONFIGS) if name.startswith("coop_128x128x128")
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_groups", "one_row"])
def test_cuda_coop_tiles_are_bitwise_equal(kind):
    _cuda_or_skip()
    assert len(COOP_TILES) >= 4, fp8_gemm.TILE_CONFIGS
    seed = _seed()
    rows, c, n, e = 1000, 1024, 384, 8  # 8 K blocks: the overlapped loop's pairs and its tail
    _, _, gs, nt_ops = _nt_operands(rows, c, n, e, kind, seed)
    _, _, _, wg_ops = _wgrad_operands(rows, 256, 384, e, kind, seed)
    # 9 K blocks: the odd tail of the overlapped loop
    _, _, _, odd_ops = _nt_operands(rows, 1152, 256, e, kind, seed)
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"
    for name, fn, ops_ in (
        ("nt", lambda t, *a: fp8_gemm.fp8_nt(*a, tile=t), nt_ops),
        ("nt_odd_k", lambda t, *a: fp8_gemm.fp8_nt(*a, tile=t), odd_ops),
        ("wgrad", lambda t, *a: fp8_gemm.fp8_wgrad(*a, rows, tile=t), wg_ops),
        ("wgrad_f32", lambda t, *a: fp8_gemm.fp8_wgrad(*a, rows, out_dtype=jnp.float32, tile=t),
         wg_ops),
    ):
        outs = {t: np.asarray(jax.jit(functools.partial(fn, t))(*ops_)) for t in COOP_TILES}
        first = outs[COOP_TILES[0]]
        assert np.isfinite(first.astype(np.float32)).all(), f"{name} {msg}"
        assert np.abs(first.astype(np.float32)).max() > 0, f"{name} {msg}: all zero"
        for t in COOP_TILES[1:]:
            np.testing.assert_array_equal(outs[t],
                                          first,
                                          err_msg=f"{name} tile {fp8_gemm.TILE_CONFIGS[t]} {msg}")
