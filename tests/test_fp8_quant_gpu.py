"""The FP8 quantization kernels (kernels/fp8_quant.cu, kernels/fp8_quant_tiles.cu) against
their references on a GPU (marked `gpu`; skipped elsewhere).

Every output is compared BITWISE with the pure-JAX reference (moe_praxis.ops.fp8.quant) run on
the CPU: the same float32 amax, product with f32(1/448), float32 reciprocal of the scale, product
and round-to-nearest-even e4m3 cast, so no tolerance (a mismatch reports how many elements
differ and by how many e4m3 / float32 steps at most). Inputs are fresh random values, with all-zero tiles, huge
(1e30) and tiny (1e-30) rows, and per-row magnitudes spread over many octaves (e4m3
subnormals). Outputs are poisoned before each call (device memory filled with 0x7f bytes,
e4m3 NaN, and freed, so XLA hands it to the kernel's outputs): a byte the kernel does not
write, padding included, differs from the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_praxis import ops
from moe_praxis.ops.fp8 import fused as fp8_fused, quant as fp8_quant
from tests import fp8_reference as ref
from tests.testutil import rel_err
from tests.testutil import seed as _seed

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda_kernels():
    info = ops.backend_info()["cuda"]
    if not info["usable"]:
        pytest.skip(f"CUDA kernels not usable here: {info['reason']}")


def poison(nbytes: int = 1 << 30):
    a = jnp.full((nbytes, ), 0x7F, jnp.uint8)
    a.block_until_ready()
    a.delete()


def on_cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*jax.device_put(args, cpu))


def _steps(a):
    """Signed integer codes, monotonic in value (e4m3 bytes, float32 bits)."""
    a = np.asarray(a)
    bits = ref.bits(a).astype(np.int64)
    sign = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def _same(got, want, msg):
    g, w = ref.bits(got), ref.bits(want)
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        ulps = int(np.max(np.abs(_steps(got) - _steps(want))))
        first = tuple(bad[0])
        raise AssertionError(
            f"{msg}: {len(bad)} of {g.size} elements differ, at most {ulps} steps; first at "
            f"{first}: got {np.asarray(got, np.float32)[first]}, want "
            f"{np.asarray(want, np.float32)[first]}")


def _input(key, shape, dtype):
    """Random values, per-row magnitudes from 2^-20 to 2^20, zero / huge / tiny rows."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape, jnp.float32)
    scaled = x * jnp.exp2(jax.random.uniform(k2, shape[:-1] + (1, ), minval=-20, maxval=20))
    if shape[-2] >= 4:
        # the tiny row's scale stays a normal float32 (subnormal arithmetic is not what the
        # recipe is about, and hosts may flush it)
        scaled = scaled.at[..., 1, :].set(0.0).at[..., 2, :].set(x[..., 2, :] * 1e30)
        scaled = scaled.at[..., 3, :].set(x[..., 3, :] * 1e-30)
    x = scaled
    return x.astype(dtype)


DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 128), (5, 384), (1000, 512), (4099, 2048)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_rows_kernel_bitwise(shape, dtype):
    seed = _seed()
    x = _input(jax.random.key(seed), shape, dtype)
    kern = jax.jit(functools.partial(fp8_quant.quantize_rows, backend="cuda"))
    poison()
    q, s_t = kern(x)
    wq, ws = on_cpu(fp8_quant.quantize_rows_reference, x)
    _same(q, wq, f"seed={seed} q")
    _same(s_t, ws, f"seed={seed} s_t")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 128, 128), (4, 256, 384), (8, 1024, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_quantize_weight_kernel_bitwise(shape, dtype):
    seed = _seed()
    w = _input(jax.random.key(seed), shape, dtype)
    if shape[1] >= 256:
        w = w.at[0, :128, :128].set(0.0)  # an all-zero block: scale 1
    kern = jax.jit(functools.partial(fp8_quant.quantize_weight, backend="cuda"))
    poison()
    got = kern(w)
    want = on_cpu(fp8_quant.quantize_weight_reference, w)
    for name, a, b in zip(("q", "qt", "s"), got, want):
        _same(a, b, f"seed={seed} {name}")


def _skewed_sizes(key, rows, e):
    """Zipf-like sizes summing to about rows, some groups empty."""
    p = 1.0 / jnp.arange(1, e + 1)**1.2
    p = jax.random.permutation(key, p / p.sum())
    sizes = np.floor(np.asarray(p) * rows).astype(np.int32)
    sizes[np.asarray(p) < np.sort(np.asarray(p))[e // 4]] = 0  # a quarter of them empty
    return sizes


GROUPED_CASES = [
    # (R, C, sizes or ('skewed', E))
    (300, 256, (0, 120, 1, 150)),  # empty, 1-row, sum < R
    (1024, 384, (256, 0, 512, 256)),  # multiples of 128
    (200, 128, (300, 5)),  # past R: clamped
    (4099, 512, ("skewed", 64)),
    (8192, 256, ("skewed", 300)),  # more groups than a block scan's chunk
    (0, 128, (0, 0, 0)),  # no rows: all padding
    (777, 128, (777, )),
    (2000, 1152, ("skewed", 8)),  # 36 column slices: whole blocks of 8 slices and a tail of 4
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: f"R{c[0]}-C{c[1]}")
def test_quantize_rows_grouped_t_kernel_bitwise(case, dtype):
    r, c, sizes = case
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    if sizes and sizes[0] == "skewed":
        sizes = _skewed_sizes(k2, r, sizes[1])
    gs = jnp.asarray(sizes, jnp.int32)
    x = _input(k1, (r, c), dtype)
    kern = jax.jit(functools.partial(fp8_quant.quantize_rows_grouped_t, backend="cuda"))
    poison()
    qt, s = kern(x, gs)
    wqt, ws = on_cpu(fp8_quant.quantize_rows_grouped_t_reference, x, gs)
    assert qt.shape == wqt.shape == (c, fp8_quant.padded_rows(r, len(sizes)))
    _same(qt, wqt, f"seed={seed} qt sizes={list(np.asarray(sizes))}")
    _same(s, ws, f"seed={seed} s")


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_swiglu_fp8_kernel_is_the_swiglu_kernel_then_rows(dtype, weighted):
    """act is bitwise the SwiGLU kernel's output (same math); (q, s_t) bitwise the L1
    reference of that act; act within the SwiGLU kernels' tolerance of the reference (1e-6
    f32, 1e-2 bf16: tests/test_kernels_gpu.py)."""
    seed = _seed()
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    r, h = 4099, 1536
    gate = (4 * jax.random.normal(k1, (r, h))).astype(dtype)
    up = _input(k2, (r, h), dtype)
    w = jax.random.uniform(k3, (r, )) if weighted else None
    kern = jax.jit(functools.partial(fp8_fused.swiglu_fp8, backend="cuda"))
    swiglu = jax.jit(functools.partial(ops.swiglu, backend="cuda"))
    poison()
    act, q, s_t = kern(gate, up, w)
    _same(act, swiglu(gate, up, w), f"seed={seed} act")
    wq, ws = on_cpu(fp8_quant.quantize_rows_reference, act)
    _same(q, wq, f"seed={seed} q")
    _same(s_t, ws, f"seed={seed} s_t")
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    want = on_cpu(fp8_fused.swiglu_fp8_reference, gate, up, w)[0]
    assert rel_err(act, want) <= tol, f"seed={seed}"


@pytest.mark.parametrize("shape", [(1, 128), (4099, 1536)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_swiglu_bwd_fp8_kernel_is_the_swiglu_bwd_kernel_then_rows(dtype, weighted, shape):
    """d gate and d up bitwise the SwiGLU backward kernel's (same math), each (q, s_t) bitwise
    the L1 reference of that gradient; dw (per-tile partial sums, then summed over the tiles)
    within 1e-5 of the SwiGLU kernel's row sums; the gradients within the SwiGLU kernels'
    tolerance of the reference (1e-6 f32, 1e-2 bf16). up has zero, huge and tiny rows."""
    seed = _seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    r, h = shape
    gate = (4 * jax.random.normal(k1, (r, h))).astype(dtype)
    up = _input(k2, (r, h), dtype)
    w = jax.random.uniform(k3, (r, )) if weighted else None
    dout = jax.random.normal(k4, (r, h)).astype(dtype)
    kern = jax.jit(functools.partial(fp8_fused.swiglu_bwd_fp8, backend="cuda"))

    @jax.jit
    def swiglu_bwd(gate, up, w, dout):
        if w is None:
            return jax.vjp(lambda g, u: ops.swiglu(g, u, backend="cuda"), gate, up)[1](dout)
        return jax.vjp(lambda g, u, ww: ops.swiglu(g, u, ww, backend="cuda"), gate, up, w)[1](dout)

    poison()
    dg, du, (qg, sg), (qu, su), dw = kern(gate, up, w, dout)
    want = swiglu_bwd(gate, up, w, dout)
    exact = on_cpu(fp8_fused.swiglu_bwd_fp8_reference, gate, up, w, dout)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for name, got, kernel, q, s, ref_grad in (("dgate", dg, want[0], qg, sg, exact[0]),
                                              ("dup", du, want[1], qu, su, exact[1])):
        _same(got, kernel, f"seed={seed} {name}")
        wq, ws = on_cpu(fp8_quant.quantize_rows_reference, got)
        _same(q, wq, f"seed={seed} {name} q")
        _same(s, ws, f"seed={seed} {name} s_t")
        assert rel_err(got, ref_grad) <= tol, f"seed={seed} {name}"
    if weighted:
        assert rel_err(dw, want[2]) <= 1e-5, f"seed={seed} dw"
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 128), (1000, 2600, 384), (4099, 8196, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_permute_fp8_kernel_bitwise(shape, dtype):
    """y, q, s_t all bitwise the reference's (a permute is exact); rows mapped outside
    [0, T) are zero (scale 1)."""
    t, r, m = shape
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = _input(k1, (t, m), dtype)
    row_map = jax.random.randint(k2, (r, ), -3, t + 3)
    kern = jax.jit(functools.partial(fp8_fused.permute_fp8, backend="cuda"))
    poison()
    got = kern(x, row_map)
    want = on_cpu(fp8_fused.permute_fp8_reference, x, row_map)
    for name, a, b in zip(("y", "q", "s_t"), got, want):
        _same(a, b, f"seed={seed} {name}")
