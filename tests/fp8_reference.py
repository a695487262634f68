"""Independent NumPy FP8 quantizers of the three operand layouts (moe_praxis/ops/fp8/quant.py),
written loop by loop from the layout statements, not from the ops code, for the CPU and GPU
tests: numpy float32 product with the float32 reciprocal of the scale, ml_dtypes' e4m3 cast
(round to nearest even)."""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
INV_MAX = np.float32(1 / 448)


def tile(v):
    """One tile (any shape, float32) -> (q e4m3 of its shape, scale float32)."""
    v = np.asarray(v, np.float32)
    amax = np.float32(np.abs(v).max()) if v.size else np.float32(0)
    s = np.float32(amax * INV_MAX) if amax > 0 else np.float32(1)
    return (v * (np.float32(1) / s)).astype(E4M3), s


def rows(x):
    """L1: x [R, C] -> q [R, C], s_t [C/128, R]."""
    x = np.asarray(x, np.float32)
    r, c = x.shape
    q, s_t = np.zeros((r, c), E4M3), np.zeros((c // 128, r), np.float32)
    for i in range(r):
        for t in range(c // 128):
            q[i, 128 * t:128 * t + 128], s_t[t, i] = tile(x[i, 128 * t:128 * t + 128])
    return q, s_t


def weight(w):
    """L2: w [E, K, N] -> q [E, K, N], qt [E, N, K], s [E, K/128, N/128]."""
    w = np.asarray(w, np.float32)
    e, k, n = w.shape
    q, s = np.zeros(w.shape, E4M3), np.zeros((e, k // 128, n // 128), np.float32)
    for g in range(e):
        for a in range(k // 128):
            for b in range(n // 128):
                blk = (g, slice(128 * a, 128 * a + 128), slice(128 * b, 128 * b + 128))
                q[blk], s[g, a, b] = tile(w[blk])
    return q, np.ascontiguousarray(q.transpose(0, 2, 1)), s


def padded_rows(r, e):
    return -(-(r + 127 * e) // 128) * 128


def groups(sizes, r):
    """[(o_g, m_g, p_g)]: rows x[o_g : o_g + m_g] (clamped to the rows left) at padded column
    p_g of L3."""
    out, o, p = [], 0, 0
    for m in sizes:
        m = int(min(max(int(m), 0), r - o))
        out.append((o, m, p))
        o, p = o + m, p + -(-m // 128) * 128
    return out


def grouped_t(x, sizes):
    """L3: x [R, C], sizes [E] -> qt [C, Rp], s [Rp/128, C] (padding zero, empty tiles scale 1)."""
    x = np.asarray(x, np.float32)
    r, c = x.shape
    rp = padded_rows(r, len(sizes))
    qt, s = np.zeros((c, rp), E4M3), np.ones((rp // 128, c), np.float32)
    for o, m, p in groups(sizes, r):
        for t in range(-(-m // 128)):
            n = min(128, m - 128 * t)
            for j in range(c):
                col = np.zeros(128, np.float32)
                col[:n] = x[o + 128 * t:o + 128 * t + n, j]
                qt[j, p + 128 * t:p + 128 * t + 128], s[(p // 128) + t, j] = tile(col)
    return qt, s


def bits(a):
    """The bytes of an array (for bitwise comparisons of e4m3 and float32 data)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)
