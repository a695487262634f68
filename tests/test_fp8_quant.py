"""The FP8 operand layouts' pure-JAX references (moe_praxis.ops.fp8.quant) on the CPU.

Every layout is compared BITWISE (e4m3 bytes and float32 scale bits) with an independent
numpy quantizer (tests/fp8_reference.py) and with fp8.quantize_tiles / quantize_blocks, the
recipe the GEMM reference dequantizes: the layouts are the recipe's numbers, only arranged.
Inputs are fresh random values with all-zero tiles, huge (1e30) and tiny (1e-30) rows.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from moe_praxis.ops.fp8 import recipe as fp8, fused as fp8_fused, quant as fp8_quant
from moe_praxis.ops.permute import permute_reference
from moe_praxis.ops.swiglu import swiglu_reference
from tests import fp8_reference as ref
from tests.testutil import rel_err
from tests.testutil import seed as _seed


def _rows_input(seed, r, c, dtype):
    x = jax.random.normal(jax.random.key(seed), (r, c), jnp.float32) * 3.0
    if r >= 4:
        x = x.at[1].set(0.0)  # all-zero tiles: scale 1
        x = x.at[2].multiply(1e30).at[3].multiply(1e-30)  # huge and tiny tiles
    return x.astype(dtype)


def _same(a, b, msg):
    np.testing.assert_array_equal(ref.bits(a), ref.bits(b), err_msg=msg)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rows_layout_bitwise(dtype):
    seed = _seed()
    x = _rows_input(seed, 37, 384, dtype)
    q, s_t = fp8_quant.quantize_rows(x, backend="xla")
    assert q.dtype == fp8_quant.E4M3 and q.shape == (37, 384)
    assert s_t.dtype == jnp.float32 and s_t.shape == (3, 37)
    qn, sn = ref.rows(np.asarray(x, np.float32))
    _same(q, qn, f"seed={seed} q")
    _same(s_t, sn, f"seed={seed} s_t")
    qr, sr = fp8.quantize_tiles(x, axis=1)
    _same(q, qr, f"seed={seed}")
    _same(s_t, sr.T, f"seed={seed}")
    assert np.all(np.asarray(s_t)[:, 1] == 1.0)
    back = fp8_quant.dequantize_rows(q, s_t)
    err = rel_err(back[4:], np.asarray(x, np.float32)[4:])
    assert 0.005 < err < 0.05, f"seed={seed} {err}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_weight_layout_bitwise(dtype):
    seed = _seed()
    w = jax.random.normal(jax.random.key(seed), (3, 256, 384), jnp.float32)
    w = w.at[1, :128, 128:256].set(0.0).at[2, 128:].multiply(1e30).at[0, :128].multiply(1e-30)
    w = w.astype(dtype)
    q, qt, s = fp8_quant.quantize_weight(w, backend="xla")
    assert (q.shape, qt.shape, s.shape) == ((3, 256, 384), (3, 384, 256), (3, 2, 3))
    assert q.dtype == qt.dtype == fp8_quant.E4M3
    qn, qtn, sn = ref.weight(np.asarray(w, np.float32))
    _same(q, qn, f"seed={seed} q")
    _same(qt, qtn, f"seed={seed} qt")
    _same(s, sn, f"seed={seed} s")
    qb, sb = fp8.quantize_blocks(w)
    _same(q, qb, f"seed={seed}")
    _same(s, sb, f"seed={seed}")
    assert float(s[1, 0, 1]) == 1.0


GROUP_CASES = [
    # (R, sizes): empty groups, a 1-row group, sum < R, exact multiples of 128, one group,
    # sizes past R (clamped as ragged_dot), skewed
    (300, (0, 120, 1, 150)),
    (256, (128, 0, 128)),
    (200, (300, 5)),
    (130, (130, )),
    (500, (0, 0, 3, 400, 0, 97)),
    (64, (0, 0)),
    (0, (0, 3)),  # no rows: all padding
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: f"R{c[0]}-{len(c[1])}groups")
def test_grouped_t_layout_bitwise(case, dtype):
    r, sizes = case
    seed = _seed()
    x = _rows_input(seed, r, 256, dtype)
    gs = jnp.array(sizes, jnp.int32)
    qt, s = fp8_quant.quantize_rows_grouped_t(x, gs, backend="xla")
    rp = fp8_quant.padded_rows(r, len(sizes))
    assert rp == ref.padded_rows(r, len(sizes)) and rp % 128 == 0
    assert qt.shape == (256, rp) and s.shape == (rp // 128, 256) and qt.dtype == fp8_quant.E4M3
    qn, sn = ref.grouped_t(np.asarray(x, np.float32), sizes)
    _same(qt, qn, f"seed={seed} qt")
    _same(s, sn, f"seed={seed} s")
    # padding is zero, and a tile never mixes two groups: each group's tiles are the 128 x 1
    # tiles of that group's rows alone
    used = np.zeros(rp, bool)
    for o, m, p in ref.groups(sizes, r):
        used[p:p + m] = True
        if m:
            want_q, want_s = fp8.quantize_tiles(jnp.asarray(x)[o:o + m], axis=0)
            _same(qt[:, p:p + want_q.shape[0]], want_q.T, f"seed={seed} group at {o}")
            _same(s[p // 128:p // 128 + want_s.shape[0]], want_s, f"seed={seed}")
    assert not np.any(np.asarray(qt, np.float32)[:, ~used]), f"seed={seed}: padding not zero"
    back = fp8_quant.dequantize_rows_grouped_t(qt, s, gs, r)
    assert back.shape == (r, 256)
    last = ref.groups(sizes, r)[-1]
    np.testing.assert_array_equal(np.asarray(back)[last[0] + last[1]:], 0.0)
    for o, m, p in ref.groups(sizes, r):
        deq = np.asarray(qn[:, p:p + m], np.float32) * np.repeat(sn[p // 128:], 128, 0)[:m].T
        np.testing.assert_array_equal(np.asarray(back)[o:o + m], deq.T, err_msg=f"seed={seed}")


def test_rows_past_the_groups_are_ignored():
    seed = _seed()
    x = _rows_input(seed, 200, 128, jnp.float32)
    gs = jnp.array([50, 60], jnp.int32)
    a = fp8_quant.quantize_rows_grouped_t(x, gs)
    b = fp8_quant.quantize_rows_grouped_t(x.at[110:].set(1e6), gs)
    for u, v in zip(a, b):
        _same(u, v, f"seed={seed}")


def test_named_errors():
    with pytest.raises(ValueError, match=r"shape \(4, 100\).*C=100 must be a multiple of 128"):
        fp8_quant.quantize_rows(jnp.zeros((4, 100)))
    with pytest.raises(ValueError, match=r"dtype float16.*float32 or bfloat16"):
        fp8_quant.quantize_rows(jnp.zeros((4, 128), jnp.float16))
    with pytest.raises(ValueError, match=r"x must be \[R, C\], got shape \(4, 2, 128\)"):
        fp8_quant.quantize_rows_grouped_t(jnp.zeros((4, 2, 128)), jnp.ones((2, ), jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes must be \[E\] with E >= 1.*\(0,\)"):
        fp8_quant.quantize_rows_grouped_t(jnp.zeros((4, 128)), jnp.ones((0, ), jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes has dtype float32"):
        fp8_quant.quantize_rows_grouped_t(jnp.zeros((4, 128)), jnp.ones((2, ), jnp.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 128, 96\).*multiples of 128"):
        fp8_quant.quantize_weight(jnp.zeros((2, 128, 96)))
    with pytest.raises(ValueError, match=r"w must be \[E, K, N\], got shape \(128, 128\)"):
        fp8_quant.quantize_weight(jnp.zeros((128, 128)))
    with pytest.raises(ValueError, match=r"kernel_backend='gpu' is invalid"):
        fp8_quant.quantize_rows(jnp.zeros((4, 128)), backend="gpu")
    with pytest.raises(ValueError, match=r"gate has shape \(4, 64\).*multiple of 128"):
        fp8_fused.swiglu_fp8(jnp.zeros((4, 64)), jnp.zeros((4, 64)))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_swiglu_fp8_reference_is_swiglu_then_rows(weighted):
    seed = _seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    gate = (jax.random.normal(k1, (40, 256)) * 2).astype(jnp.bfloat16)
    up = jax.random.normal(k2, (40, 256)).astype(jnp.bfloat16)
    w = jax.random.uniform(k3, (40, )) if weighted else None
    act, q, s_t = fp8_fused.swiglu_fp8(gate, up, w, backend="xla")
    want = swiglu_reference(gate, up, w)
    _same(act, want, f"seed={seed}")
    qn, sn = ref.rows(np.asarray(want, np.float32))
    _same(q, qn, f"seed={seed}")
    _same(s_t, sn, f"seed={seed}")
    # differentiable through act, as the SwiGLU
    cot = jax.random.normal(k4, (40, 256)).astype(jnp.bfloat16)
    got = jax.vjp(lambda g, u: fp8_fused.swiglu_fp8(g, u, w, backend="xla")[0], gate, up)[1](cot)
    exp = jax.vjp(lambda g, u: swiglu_reference(g, u, w), gate, up)[1](cot)
    for a, b in zip(got, exp):
        _same(a, b, f"seed={seed}")


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_swiglu_bwd_fp8_reference_is_swiglu_bwd_then_rows(weighted):
    """d gate and d up are autodiff of swiglu_reference (bitwise), each (q, s_t) the NumPy L1
    quantizer's of that gradient as rounded; dw the routing weight's gradient (None without)."""
    seed = _seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    gate = (jax.random.normal(k1, (40, 256)) * 2).astype(jnp.bfloat16)
    up = jax.random.normal(k2, (40, 256)).astype(jnp.bfloat16)
    w = jax.random.uniform(k3, (40, )) if weighted else None
    dout = jax.random.normal(k4, (40, 256)).astype(jnp.bfloat16)
    dg, du, (qg, sg), (qu, su), dw = fp8_fused.swiglu_bwd_fp8(gate, up, w, dout, backend="xla")
    if weighted:
        want = jax.vjp(lambda g, u, ww: swiglu_reference(g, u, ww), gate, up, w)[1](dout)
        _same(dw, want[2], f"seed={seed}")
    else:
        want = jax.vjp(lambda g, u: swiglu_reference(g, u), gate, up)[1](dout)
        assert dw is None
    for got, exp, q, s in ((dg, want[0], qg, sg), (du, want[1], qu, su)):
        _same(got, exp, f"seed={seed}")
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32)))) > 0
        qn, sn = ref.rows(np.asarray(exp, np.float32))
        _same(q, qn, f"seed={seed}")
        _same(s, sn, f"seed={seed}")
    with pytest.raises(ValueError, match=r"gate, up and dout must have one shape"):
        fp8_fused.swiglu_bwd_fp8(gate, up, w, dout[:4])
    with pytest.raises(ValueError, match=r"weights must be \[R=40\], got \(4,\)"):
        fp8_fused.swiglu_bwd_fp8(gate, up, jnp.ones((4, )), dout)


def test_permute_fp8_reference_is_permute_then_rows():
    seed = _seed()
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = _rows_input(seed, 30, 256, jnp.bfloat16)
    row_map = jax.random.randint(k1, (70, ), -2, 33)  # some rows outside [0, T): zeros
    y, q, s_t = fp8_fused.permute_fp8(x, row_map, backend="xla")
    want = permute_reference(x, row_map)
    _same(y, want, f"seed={seed}")
    qn, sn = ref.rows(np.asarray(want, np.float32))
    _same(q, qn, f"seed={seed}")
    _same(s_t, sn, f"seed={seed}")
    cot = jax.random.normal(k3, (70, 256)).astype(jnp.bfloat16)
    got = jax.vjp(lambda a: fp8_fused.permute_fp8(a, row_map, backend="xla")[0], x)[1](cot)
    exp = jax.vjp(lambda a: permute_reference(a, row_map), x)[1](cot)
    _same(got[0], exp[0], f"seed={seed}")
    with pytest.raises(ValueError, match=r"row_map must be \[R\] integers.*float32"):
        fp8_fused.permute_fp8(x, jnp.zeros((4, )), backend="xla")
