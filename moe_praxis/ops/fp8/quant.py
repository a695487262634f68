"""FP8 (e4m3) quantization: the blockwise recipe's scales and the three operand layouts.

One rule everywhere (DeepSeek-V3's, moe_praxis.ops.fp8 builds its GEMMs on it):

    scale = amax(tile) * f32(1/448)  (448: e4m3's largest finite value; an all-zero tile has
                                      scale 1; a product, not a quotient, so every
                                      implementation rounds it the same way)
    q     = e4m3(x * (1 / scale))  (1 / scale: one float32 IEEE reciprocal per tile, then a
                                    float32 product per element; round to nearest even;
                                    |q| <= 448 up to rounding, so no overflow)

(A product with the reciprocal, not a quotient: XLA rewrites a division by a broadcast scale
into exactly this, so writing it out keeps the reference the same on every backend and lets
the kernels match it bitwise; it is also one division per tile instead of per element.)

The layouts the FP8 grouped GEMM kernels read (CUTLASS's sm90 blockwise mainloop takes
MN-major scales only, hence the transposed scale arrays). Letters: R rows (token copies),
C their width (the contraction of the GEMM that reads them), E experts, K x N a weight.

    L1 row tiles     quantize_rows(x [R, C]) -> q [R, C], s_t [C/128, R]
                     tiles 1 x 128 along C (forward lhs, dgrad dy, the SwiGLU output)
    L2 weight blocks quantize_weight(w [E, K, N]) -> q [E, K, N], qt [E, N, K],
                     s [E, K/128, N/128]; a 128 x 128 block is its transpose's block, so one
                     s serves q (dgrad's B) and qt (forward's B)
    L3 grouped rows, quantize_rows_grouped_t(x [R, C], group_sizes [E]) -> qt [C, Rp],
       transposed    s [Rp/128, C], Rp = padded_rows(R, E) = round_up(R + 127 E, 128)
                     (wgrad's operands: the contraction runs over the rows of a group)

L3 in words: group g's rows (its m_g rows of x from o_g = sum_{j<g} m_j, sizes clamped to the
rows left as ragged_dot does) go to the padded columns [P_g, P_g + m_g) of qt,
P_g = sum_{j<g} round_up(m_g, 128); tiles of 128 rows start at each group's first row, so a
tile never mixes groups. qt is zero at every padding position and past the last group, where
the tiles (all zero) have scale 1. Rows past sum(group_sizes) are ignored.

Every quantizer takes `backend=` ('auto' | 'xla' | 'cuda', as ops.swiglu): 'cuda' runs its
kernel (kernels/fp8_quant.cu and fp8_quant_tiles.cu, bitwise equal to the reference here)
through platform_call.
moe_praxis.ops.fp8.fused holds the SwiGLU forward and the permute that write their output as
L1 in the same pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
_INV_MAX = np.float32(1.0 / E4M3_MAX)
BLOCK = 128
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# ---------------------------------------------------------------- the rule, any tile shape


def _scale(amax):
    return jnp.where(amax > 0, amax.astype(jnp.float32) * _INV_MAX, jnp.float32(1.0))


def _reciprocal(s):
    # 1 / s of the unbroadcast scales: an IEEE float32 division per tile
    return jnp.float32(1.0) / s


def _pad_to_block(x, axis: int):
    pad = -x.shape[axis] % BLOCK
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _materialized(q):
    """q as e4m3 values that a later conversion back to float32 cannot skip: XLA:GPU's
    SimplifyFPConversions (under xla_allow_excess_precision, on by default) folds a chain
    f32 -> e4m3 -> f32 into nothing, so a quantize-dequantize inside one jit would not round
    at all; an optimization barrier keeps the e4m3 value."""
    return jax.lax.optimization_barrier(q)


def quantize_tiles(x, axis: int = -1):
    """1 x 128 tiles along `axis` (zero-padded to a multiple of 128) -> (q e4m3 with the padded
    shape, scales float32 with `axis` divided by 128)."""
    axis = axis % x.ndim
    x = _pad_to_block(x.astype(jnp.float32), axis)
    shape = x.shape
    tiled = x.reshape(shape[:axis] + (shape[axis] // BLOCK, BLOCK) + shape[axis + 1:])
    s = _scale(jnp.max(jnp.abs(tiled), axis=axis + 1))
    q = _materialized((tiled * jnp.expand_dims(_reciprocal(s), axis + 1)).astype(E4M3))
    return q.reshape(shape), s


def dequantize_tiles(q, s, axis: int = -1):
    axis = axis % q.ndim
    shape = q.shape
    tiled = q.astype(jnp.float32).reshape(shape[:axis] + (shape[axis] // BLOCK, BLOCK) +
                                          shape[axis + 1:])
    return (tiled * jnp.expand_dims(s, axis + 1)).reshape(shape)


def check_blocks(shape, what: str) -> None:
    """The last two dims of a weight must be multiples of 128 (whole 128x128 blocks)."""
    if shape[-1] % BLOCK or shape[-2] % BLOCK:
        raise ValueError(f"fp8='blockwise': {what} has shape {tuple(shape)}; its last two "
                         f"dimensions must be multiples of {BLOCK} (whole {BLOCK}x{BLOCK} "
                         "blocks): use d_model and d_ff that are")


def quantize_blocks(w):
    """w [..., K, N] (K, N multiples of 128) -> (q e4m3 [..., K, N], scales [..., K/128, N/128])."""
    check_blocks(w.shape, "the weight")
    *lead, k, n = w.shape
    b = w.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    s = _scale(jnp.max(jnp.abs(b), axis=(-3, -1)))
    q = _materialized((b * _reciprocal(s)[..., :, None, :, None]).astype(E4M3))
    return q.reshape(w.shape), s


def dequantize_blocks(q, s):
    *lead, k, n = q.shape
    b = q.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    return (b * s[..., :, None, :, None]).reshape(q.shape)


# ------------------------------------------------------------------------ shape checks


def _check_float(x, what: str) -> None:
    if jnp.dtype(x.dtype) not in _FLOATS:
        raise ValueError(f"{what} has dtype {x.dtype}; the FP8 quantizers take float32 or "
                         "bfloat16")


def check_rows(x, what: str) -> None:
    """x must be [R, C], float32 or bfloat16, C a multiple of 128 (whole 1 x 128 tiles)."""
    if x.ndim != 2:
        raise ValueError(f"{what} must be [R, C], got shape {tuple(x.shape)}")
    _check_float(x, what)
    if x.shape[1] % BLOCK:
        raise ValueError(f"{what} has shape {tuple(x.shape)}; its width C={x.shape[1]} must be "
                         f"a multiple of {BLOCK} (whole 1 x {BLOCK} tiles)")


def _check_group_sizes(group_sizes) -> None:
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(f"group_sizes must be [E] with E >= 1, got shape "
                         f"{tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes has dtype {group_sizes.dtype}; an integer dtype is needed")


def padded_rows(rows: int, num_groups: int) -> int:
    """Rp of L3: round_up(rows + 127 * num_groups, 128), room for every group's last partial
    tile whatever the sizes (static, so no size leaves the device)."""
    return -(-(rows + (BLOCK - 1) * num_groups) // BLOCK) * BLOCK


# ------------------------------------------------------------------- L1: row tiles


def quantize_rows_reference(x):
    """L1: x [R, C] (C % 128 == 0) -> (q e4m3 [R, C], s_t float32 [C/128, R])."""
    check_rows(x, "x")
    q, s = quantize_tiles(x, axis=1)
    return q, s.T


def dequantize_rows(q, s_t):
    """L1 back to float32 [R, C]."""
    return dequantize_tiles(q, s_t.T, axis=1)


def rows_out(x):
    """The abstract outputs of L1 of x [R, C]: q e4m3 [R, C], s_t float32 [C/128, R]."""
    r, c = x.shape
    return (jax.ShapeDtypeStruct((r, c), E4M3), jax.ShapeDtypeStruct((c // BLOCK, r), jnp.float32))


def _rows_ffi(x):
    return tuple(ffi("moe_fp8_quantize_rows", rows_out(x), x))


def quantize_rows(x, *, backend: str = "auto"):
    """L1 row tiles (module doc): x [R, C] float32 / bfloat16, C a multiple of 128 ->
    (q e4m3 [R, C], s_t float32 [C/128, R]). backend 'cuda': the kernel (bitwise equal)."""
    check_rows(x, "x")
    if _backend.op_backend(backend, "fp8_quant") == "cuda":
        return platform_call(_rows_ffi, quantize_rows_reference, x)
    return quantize_rows_reference(x)


# --------------------------------------------------------------- L2: weight blocks


def _check_weight(w) -> None:
    if w.ndim != 3:
        raise ValueError(f"w must be [E, K, N], got shape {tuple(w.shape)}")
    _check_float(w, "w")
    check_blocks(w.shape, "the weight")


def quantize_weight_reference(w):
    """L2: w [E, K, N] -> (q e4m3 [E, K, N], qt e4m3 [E, N, K], s float32 [E, K/128, N/128])."""
    _check_weight(w)
    q, s = quantize_blocks(w)
    return q, jnp.swapaxes(q, 1, 2), s


def _weight_ffi(w):
    e, k, n = w.shape
    out = (jax.ShapeDtypeStruct((e, k, n), E4M3), jax.ShapeDtypeStruct(
        (e, n, k), E4M3), jax.ShapeDtypeStruct((e, k // BLOCK, n // BLOCK), jnp.float32))
    return tuple(ffi("moe_fp8_quantize_weight", out, w))


def quantize_weight(w, *, backend: str = "auto"):
    """L2 weight blocks (module doc): w [E, K, N] float32 / bfloat16, K and N multiples of 128
    -> (q [E, K, N], qt [E, N, K], s [E, K/128, N/128]). backend 'cuda': one kernel pass."""
    _check_weight(w)
    if _backend.op_backend(backend, "fp8_quant") == "cuda":
        return platform_call(_weight_ffi, quantize_weight_reference, w)
    return quantize_weight_reference(w)


# ------------------------------------------------ L3: grouped row tiles, transposed


def grouped_offsets(group_sizes, rows: int):
    """(o, m, p) [E] int32 each: the rows of group g are x[o_g : o_g + m_g] (sizes clamped to
    the rows left, negative ones to 0, as ragged_dot), its padded columns start at
    p_g = sum_{j<g} round_up(m_j, 128)."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), rows)
    o = jnp.concatenate([jnp.zeros((1, ), jnp.int32), ends[:-1]])
    m = ends - o
    padded = (m + BLOCK - 1) // BLOCK * BLOCK
    return o, m, jnp.cumsum(padded) - padded


def _padded_sources(group_sizes, rows: int, num_cols: int):
    """For each padded column p < num_cols of L3: the row of x it holds, or `rows` (none)."""
    o, m, p0 = grouped_offsets(group_sizes, rows)
    e = o.shape[0]
    p = jnp.arange(num_cols, dtype=jnp.int32)
    pend = p0 + (m + BLOCK - 1) // BLOCK * BLOCK
    g = jnp.searchsorted(pend, p, side="right")
    gc = jnp.minimum(g, e - 1)
    j = p - p0[gc]
    valid = (g < e) & (j < m[gc])
    return jnp.where(valid, o[gc] + j, rows)


def quantize_rows_grouped_t_reference(x, group_sizes):
    """L3: x [R, C], group_sizes [E] -> (qt e4m3 [C, Rp], s float32 [Rp/128, C])."""
    check_rows(x, "x")
    _check_group_sizes(group_sizes)
    rows, rp = x.shape[0], padded_rows(x.shape[0], group_sizes.shape[0])
    if rows == 0:  # all padding (jnp.take cannot read an empty axis)
        xp = jnp.zeros((rp, x.shape[1]), jnp.float32)
    else:
        src = _padded_sources(group_sizes, rows, rp)
        xp = jnp.take(x.astype(jnp.float32), src, axis=0, mode="fill", fill_value=0)
    q, s = quantize_tiles(xp, axis=0)
    return q.T, s


def dequantize_rows_grouped_t(qt, s, group_sizes, rows: int):
    """L3 back to float32 [rows, C]: row r of group g from padded column p_g + r - o_g; rows
    past sum(group_sizes) are zero."""
    o, m, p0 = grouped_offsets(group_sizes, rows)
    xp = dequantize_tiles(qt.T, s, axis=0)
    r = jnp.arange(rows, dtype=jnp.int32)
    g = jnp.searchsorted(o + m, r, side="right")
    gc = jnp.minimum(g, o.shape[0] - 1)
    col = jnp.where(g < o.shape[0], p0[gc] + r - o[gc], qt.shape[1])
    return jnp.take(xp, col, axis=0, mode="fill", fill_value=0)


def _grouped_ffi(x, group_sizes):
    (r, c), e = x.shape, group_sizes.shape[0]
    rp = padded_rows(r, e)
    out = (jax.ShapeDtypeStruct((c, rp), E4M3), jax.ShapeDtypeStruct((rp // BLOCK, c), jnp.float32))
    return tuple(ffi("moe_fp8_quantize_rows_grouped_t", out, x, group_sizes))


def quantize_rows_grouped_t(x, group_sizes, *, backend: str = "auto"):
    """L3 grouped row tiles, transposed (module doc): x [R, C] float32 / bfloat16, C a
    multiple of 128, group_sizes [E] integers (on the device; no host sync) ->
    (qt e4m3 [C, Rp], s float32 [Rp/128, C]), Rp = padded_rows(R, E). backend 'cuda': the
    kernel (a device-side scan of group_sizes, padding zero-filled)."""
    check_rows(x, "x")
    _check_group_sizes(group_sizes)
    gs = group_sizes.astype(jnp.int32)
    if _backend.op_backend(backend, "fp8_quant") == "cuda":
        return platform_call(_grouped_ffi, quantize_rows_grouped_t_reference, x, gs)
    return quantize_rows_grouped_t_reference(x, gs)
