"""Blockwise FP8 grouped GEMM reference (moe_praxis.ops.fp8) on the CPU.

Tolerances:
- the quantizer against an independent numpy / ml_dtypes one: bitwise;
- the GEMMs against float64 products of the SAME dequantized operands: 1e-6 norm-wise (float32
  accumulation of K <= 512 terms);
- against float64 of the unquantized inputs: e4m3 keeps 3 mantissa bits, so each operand is
  off by at most 2^-4 relative (half an ulp) and a product of two by about 2 x 2^-4; with
  random signs the errors add like a random walk, and the norm-wise error of a GEMM output is
  about the rms of that, sqrt(2/3) x 2^-4 ~ 0.05. Bound: 0.08. It must also be above 0.005,
  or nothing was quantized.
"""

import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_praxis.ops import backend as ops_backend
from moe_praxis.ops.fp8 import recipe as fp8, fused as fp8_fused
from moe_praxis.ops.grouped_gemm import grouped_gemm_wgrad_reference
from tests.moe_reference import block_inputs
from tests.testutil import rel_err
from tests.testutil import seed as _seed

K, N, E = 256, 384, 4
FP8_BOUND = 0.08
ROUTER_FP8_BOUND = 0.12  # the router's gradient in the FP8 block (see its test)


def _np_quantize_tiles(x):
    """Independent 1x128 quantizer along the last axis (numpy float32, ml_dtypes cast)."""
    t = np.asarray(x, np.float32).reshape(x.shape[0], -1, 128)
    amax = np.abs(t).max(-1)
    s = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
    q = (t * (np.float32(1) / s)[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), s


def _np_dequantize_group_tiles(x, sizes):
    """Independent per-group 128 x 1 tiles along the rows of x [R, C]: each group's rows
    zero-padded to whole tiles, quantized and dequantized (float32); rows past the groups 0."""
    out, start = np.zeros(x.shape, np.float32), 0
    for m in sizes:
        m = int(min(max(m, 0), x.shape[0] - start))
        g = np.zeros((-(-m // 128) * 128, x.shape[1]), np.float32)
        g[:m] = x[start:start + m]
        q, s = _np_quantize_tiles(g.T)
        deq = (q.astype(np.float32).reshape(g.shape[1], -1, 128) * s[..., None]).reshape(g.T.shape)
        out[start:start + m] = deq.T[:m]
        start += m
    return out


def _inputs(seed, rows=300, sizes=(0, 120, 1, 150)):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (rows, K), jnp.float32)
    w = jax.random.normal(k2, (E, K, N), jnp.float32) / np.sqrt(K)
    return x, w, jnp.array(sizes, jnp.int32)  # an empty group, a 1-row group, sum < rows


def _f64_grouped(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for e, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


def test_quantize_tiles_matches_independent_quantizer_bitwise():
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (64, 2 * 128)) * 3.0
    x = x.at[5, :128].set(0.0)  # an all-zero tile: scale 1
    q, s = fp8.quantize_tiles(x)
    qn, sn = _np_quantize_tiles(np.asarray(x))
    np.testing.assert_array_equal(np.asarray(s), sn, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), qn.view(np.uint8))
    assert float(s[5, 0]) == 1.0
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0  # each tile's amax maps to 448


def test_blocks_roundtrip_and_shape_errors():
    seed = _seed()
    w = jax.random.normal(jax.random.key(seed), (2, 256, 128))
    q, s = fp8.quantize_blocks(w)
    assert q.dtype == fp8.E4M3 and s.shape == (2, 2, 1)
    err = rel_err(fp8.dequantize_blocks(q, s), w)
    assert 0.005 < err < FP8_BOUND / 2, f"seed={seed} {err}"
    with pytest.raises(ValueError, match=r"shape \(2, 100, 128\).*multiples of 128"):
        fp8.quantize_blocks(jnp.zeros((2, 100, 128)))


def test_forward_equals_float64_of_dequantized_operands_and_bound_of_unquantized():
    seed = _seed()
    x, w, sizes = _inputs(seed)
    y = fp8.fp8_grouped_gemm(x, w, sizes)
    xq, xs = fp8.quantize_tiles(x)
    wq, ws = fp8.quantize_blocks(w)
    exact = _f64_grouped(fp8.dequantize_tiles(xq, xs), fp8.dequantize_blocks(wq, ws), sizes)
    assert rel_err(y, exact) < 1e-6, f"seed={seed}"
    err = rel_err(y, _f64_grouped(x, w, sizes))
    assert 0.005 < err < FP8_BOUND, f"seed={seed} fp8 error {err}"
    assert float(jnp.max(jnp.abs(y[int(sizes.sum()):]))) == 0.0  # rows past the sum


def test_gradients_within_fp8_bound_and_empty_group_zero():
    seed = _seed()
    x, w, sizes = _inputs(seed)
    cot = jax.random.normal(jax.random.key(seed + 1), (x.shape[0], N))
    _, vjp = jax.vjp(lambda a, b: fp8.fp8_grouped_gemm(a, b, sizes), x, w)
    dx, dw = vjp(cot)
    with jax.default_matmul_precision("highest"):
        _, vjp_ref = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
        rdx, rdw = vjp_ref(cot)
    used = int(sizes.sum())
    ex = rel_err(dx[:used], rdx[:used])
    ew = rel_err(dw, rdw)
    assert 0.005 < ex < FP8_BOUND and 0.005 < ew < FP8_BOUND, f"seed={seed} dx {ex} dw {ew}"
    assert float(jnp.max(jnp.abs(dw[0]))) == 0.0  # the empty expert
    # the backward's operands are really quantized along the stated axes: 128-row tiles that
    # start at each group's first row (fp8_quant's L3), independent numpy quantizer per group
    deq = lambda a: _np_dequantize_group_tiles(np.asarray(a), np.asarray(sizes))
    with jax.default_matmul_precision("highest"):
        want = grouped_gemm_wgrad_reference(deq(x), deq(cot), sizes)
    assert rel_err(dw, want) < 1e-6, f"seed={seed}"


@pytest.mark.parametrize("gather_dim", [0, 1], ids=["fsdp-on-experts", "fsdp-on-model"])
def test_quantize_before_gather_bitwise_equals_gather_then_quantize(gather_dim):
    """fsdp4 x ep2: each ep rank holds E/2 experts, sharded over fsdp on the expert dim (or on
    d_model) and gathered inside shard_map; every device has its own tokens and group sizes,
    so the weight gradients are really summed over the fsdp shards."""
    seed = _seed()
    devices = np.array(jax.devices("cpu")[:8]).reshape(4, 2)
    mesh = Mesh(devices, ("fsdp", "ep"))
    e, rows = 8, 48  # 4 local experts and 48 rows per device
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k1, (8 * rows, 512), jnp.float32)
    w = (jax.random.normal(k2, (e, 512, N)) / np.sqrt(512)).astype(jnp.bfloat16)
    # per device: 4 local group sizes summing to <= 48, some empty
    cuts = np.sort(np.asarray(jax.random.randint(k4, (8, 3), 0, rows + 1)), axis=1)
    sizes = np.diff(np.concatenate([np.zeros((8, 1)), cuts, np.full((8, 1), rows - 5)], 1), axis=1)
    sizes = jnp.asarray(np.clip(sizes, 0, None).reshape(-1), jnp.int32)
    cot = jax.random.normal(k3, (x.shape[0], N))
    w_spec = P("ep", "fsdp") if gather_dim == 1 else P(("ep", "fsdp"))
    tok = P(("ep", "fsdp"))

    def run(quantize_first):

        def local(x, w, sizes, cot):

            def f(x, w):
                if quantize_first:
                    return fp8.gathered_fp8_grouped_gemm(x, w, sizes, "fsdp", gather_dim)
                full = jax.lax.all_gather(w, "fsdp", axis=gather_dim, tiled=True)
                return fp8.fp8_grouped_gemm(x, full, sizes)

            y, vjp = jax.vjp(f, x, w)
            return (y, ) + vjp(cot)

        return jax.jit(
            jax.shard_map(local,
                          mesh=mesh,
                          in_specs=(tok, w_spec, tok, tok),
                          out_specs=(tok, tok, w_spec),
                          check_vma=False))

    args = (x, w, sizes, cot)
    got, want = run(True)(*args), run(False)(*args)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32),
                                      np.asarray(b, np.float32),
                                      err_msg=f"seed={seed} {name}")
    assert float(jnp.max(jnp.abs(got[2].astype(jnp.float32)))) > 0  # gradients reach the master
    hlo = run(True).lower(*args).as_text()
    gathers = [l for l in hlo.splitlines() if "all_gather" in l or "all-gather" in l]
    assert any("f8E4M3FN" in l for l in gathers), gathers
    assert not any("bf16" in l for l in gathers), gathers  # no bf16 weight gather
    hlo_ref = run(False).lower(*args).as_text()
    assert any("bf16" in l for l in hlo_ref.splitlines() if "all_gather" in l)


def test_shard_not_whole_blocks_is_named_error():
    with pytest.raises(ValueError, match=r"shard has shape \(1, 64, 384\).*multiples of 128"):
        fp8.check_shard_blocks((1, 64, 384), 1, "the expert weight")


def test_moe_block_fp8_within_bound_of_float32_and_routes_the_same():
    """MoEConfig.fp8='blockwise': the whole block (outputs and every gradient) within the fp8
    bound of the same block in float32 at 'highest' precision, routing unchanged (the router
    stays float32), and really quantized (error above 0.005)."""
    import moe_praxis as mp

    seed = _seed()
    base = mp.MoEConfig(d_model=128, d_ff=256, num_experts=4, top_k=2, kernel_backend="xla")
    cfg = mp.MoEConfig(d_model=128,
                       d_ff=256,
                       num_experts=4,
                       top_k=2,
                       kernel_backend="xla",
                       fp8="blockwise",
                       fp8_gemms="all")
    params, x, cot = block_inputs(base, (2, 96, 128), seed)

    def run(c):

        def loss(p, x):
            o = mp.moe_block(p, x, c)
            return jnp.sum(o.y * cot) + o.aux_loss, o

        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    ops_backend.reset_warnings()  # warn_once's memory: another test may have warned first
    with pytest.warns(RuntimeWarning, match="emulation of FP8"):
        (_, o8), (g8, dx8) = run(cfg)
    (_, o32), (g32, dx32) = run(base)
    np.testing.assert_array_equal(np.asarray(o8.tokens_per_expert),
                                  np.asarray(o32.tokens_per_expert))
    for name, a, b in [("y", o8.y, o32.y),
                       ("dx", dx8, dx32)] + [("d" + n, g8[n], g32[n])
                                             for n in ("wi_gate", "wi_up", "wo")]:
        err = rel_err(a, b)
        assert 0.005 < err < FP8_BOUND, f"seed={seed} {name}: {err}"
    # the router's gradient flows through the routing weights only; it is a difference of
    # products of the FP8 expert outputs (the softmax Jacobian) over a 128 x 4 matrix, so its
    # relative error spreads wider than the others': over 301 seeds on the CPU (2026-12-03)
    # median 0.065, max 0.088, against 0.067 for the worst other quantity
    assert rel_err(g8["router"], g32["router"]) < ROUTER_FP8_BOUND, f"seed={seed}"


@pytest.mark.parametrize("gemms", ["all", "auto"])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "plain"])
def test_moe_block_fp8_kernel_path_equals_emulation(monkeypatch, gated, gemms):
    """The FP8 kernels' FFN (experts._fp8_kernel_ffn: the permute's FP8 rows shared by gate and
    up, the SwiGLU writing the down projection's FP8 operand, ops.fp8.recipe.fp8_gemms_shared_lhs),
    forced on the CPU where each kernel lowers to its reference, against the pure-JAX emulation
    of the same recipe, in bfloat16 (both paths round every GEMM output to bf16 and quantize
    the same operands): outputs and gradients equal up to float32 summation order (the kernel
    path adds the two dgrads in float32, its wgrads sum per group): bound 1e-5 norm-wise (seen:
    0 for y and dx, 7e-8 for the weights), with every gradient nonzero. Routing unchanged.
    fp8_gemms='auto' (here: the forwards in FP8, dgrads and wgrads in bf16, ops.fp8.mixed) too,
    with the weights' FP8 form given (at these 80 rows per expert 'auto' quantizing its own
    weights would run the bf16 layer: test_fp8_rows_rule)."""
    import moe_praxis as mp

    seed = _seed()
    cfg = mp.MoEConfig(d_model=256,
                       d_ff=384,
                       num_experts=4,
                       top_k=2,
                       gated=gated,
                       kernel_backend="xla",
                       fp8="blockwise",
                       fp8_gemms=gemms)
    params, x, cot = block_inputs(cfg, (2, 80, 256), seed, jnp.bfloat16)

    def run():
        fws = mp.quantize_expert_weights(params, cfg)["fp8_weights"] if gemms == "auto" else None

        def loss(p, f, x):
            o = mp.moe_block(p if f is None else {**p, "fp8_weights": f}, x, cfg)
            return jnp.sum(o.y * cot), o

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(params, fws, x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulation's (once per process)
        (_, oe), (ge, dxe) = run()
    monkeypatch.setattr(fp8, "resolve", lambda backend: "cuda")
    (_, ok), (gk, dxk) = run()
    np.testing.assert_array_equal(np.asarray(ok.tokens_per_expert),
                                  np.asarray(oe.tokens_per_expert))
    names = ("wi_gate", "wi_up", "wo") if gated else ("wi_up", "wo")
    want = {"all": {"fwd+dgrad+wgrad"}, "auto": {"fwd"}}[gemms]
    assert {c.label() for _, c in ok.fp8_gemms} == want == {c.label() for _, c in oe.fp8_gemms}
    for name, a, b in [("y", ok.y, oe.y),
                       ("dx", dxk, dxe)] + [("d" + n, gk[n], ge[n]) for n in names]:
        err = rel_err(a, b)
        assert err < 1e-5 and float(jnp.max(jnp.abs(a))) > 0, f"seed={seed} {name}: {err}"


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_gate_up_swiglu_fp8_equals_shared_lhs_then_swiglu_fp8(weighted):
    """ops.fp8.recipe.gate_up_swiglu_fp8 (its backward's SwiGLU writes the dgrads' FP8 operands)
    against the ops it fuses, fp8_gemms_shared_lhs then fp8_fused.swiglu_fp8, both on the CPU
    (each kernel lowered to its reference): act, its L1 and every gradient (x, both weights,
    the routing weights) bitwise equal, on groups with an empty and a one-row group and rows
    past the groups."""
    seed = _seed()
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    rows, m, h = 300, 256, 384
    sizes = jnp.array([0, 120, 1, 150], jnp.int32)
    x = jax.random.normal(k1, (rows, m)).astype(jnp.bfloat16)
    wg, wu = (jax.random.normal(k, (4, m, h)) / np.sqrt(m) for k in (k2, k3))
    rw = jax.random.uniform(k4, (rows, )) if weighted else None
    cot = jax.random.normal(k5, (rows, h)).astype(jnp.bfloat16)

    def fused(x, wg, wu, rw):
        act, q, s_t = fp8.gate_up_swiglu_fp8(x, None, wg, wu, sizes, rw)
        return jnp.sum(act.astype(jnp.float32) * cot), (act, q, s_t)

    def parts(x, wg, wu, rw):
        gate, up = fp8.fp8_gemms_shared_lhs(x, None, (wg, wu), sizes)
        act, q, s_t = fp8_fused.swiglu_fp8(gate, up, rw, backend="auto")
        return jnp.sum(act.astype(jnp.float32) * cot), (act, q, s_t)

    args = (x, wg, wu, rw)
    argnums = (0, 1, 2, 3) if weighted else (0, 1, 2)
    (_, got), g_got = jax.jit(jax.value_and_grad(fused, argnums, has_aux=True))(*args)
    (_, want), g_want = jax.jit(jax.value_and_grad(parts, argnums, has_aux=True))(*args)
    for a, b in zip(got + g_got, want + g_want):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)), f"seed={seed}")
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32)))) > 0, f"seed={seed}"


def test_shared_lhs_names_a_mismatched_fp8_operand():
    x, w, sizes = _inputs(_seed())
    q, s_t = fp8.quantize_rows(x)
    with pytest.raises(ValueError, match=r"lhs_fp8 must be \(q \(300, 256\), s_t \(2, 300\)\)"):
        fp8.fp8_gemms_shared_lhs(x, (q[:10], s_t), (w, ), sizes)


def test_fp8_config_errors_name_the_value():
    import moe_praxis as mp

    with pytest.raises(ValueError, match=r"MoEConfig.fp8='blockwise'.*multiples of 128.*d_ff=96"):
        mp.MoEConfig(d_model=128, d_ff=96, num_experts=4, fp8="blockwise")
    with pytest.raises(ValueError, match=r"MoEConfig.fp8='e5m2' is invalid"):
        mp.MoEConfig(d_model=128, d_ff=128, num_experts=4, fp8="e5m2")
    with pytest.raises(ValueError, match="fuse_gate_up"):
        mp.MoEConfig(d_model=128, d_ff=128, num_experts=4, fp8="blockwise", fuse_gate_up=True)


@pytest.mark.parametrize("fsdp_dim", ["expert", "model"])
def test_block_quantize_before_gather_bitwise_equals_gather_then_quantize(fsdp_dim):
    """moe_block with fp8='blockwise' on fsdp4 x ep2: quantizing each weight shard before the
    all-gather gives bitwise the outputs and gradients of gathering first; the lowered step's
    weight all-gathers carry e4m3 in one order and the weights' dtype in the other."""

    import moe_praxis as mp

    seed = _seed()
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("fsdp", "ep"))
    res = mp.MeshResources(fsdp="fsdp", ep="ep", fsdp_dim=fsdp_dim)
    m = 512 if fsdp_dim == "model" else 128  # d_model / 4 shards of whole 128-blocks
    cfg = mp.MoEConfig(d_model=m,
                       d_ff=256,
                       num_experts=8,
                       top_k=2,
                       kernel_backend="xla",
                       fp8="blockwise",
                       fp8_gemms="all")
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), mp.init_moe_params(k1, cfg))
    x = jax.random.normal(k2, (8, 32, m)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, x.shape).astype(jnp.bfloat16)

    def step(c):

        def loss(p, x):
            o = mp.moe_block(p, x, c, mesh=mesh, resources=res)
            return jnp.sum((o.y * cot).astype(jnp.float32)) + o.aux_loss, o.y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    before = step(cfg)
    after = step(dataclasses.replace(cfg, fp8_quantize_before_gather=False))
    (_, y1), g1 = before(params, x)
    (_, y2), g2 = after(params, x)
    for a, b in zip([y1] + jax.tree.leaves(g1), [y2] + jax.tree.leaves(g2)):
        np.testing.assert_array_equal(np.asarray(a, np.float32),
                                      np.asarray(b, np.float32),
                                      err_msg=f"seed={seed}")
    assert float(jnp.max(jnp.abs(g1[0]["wo"].astype(jnp.float32)))) > 0

    def gathers(f):
        return [l for l in f.lower(params, x).as_text().splitlines() if "all_gather" in l]

    assert any("f8E4M3FN" in l for l in gathers(before)), gathers(before)
    assert not any("f8E4M3FN" in l for l in gathers(after))
    assert any("bf16" in l for l in gathers(after))


def test_quantize_before_gather_needs_whole_blocks_per_shard():
    import moe_praxis as mp

    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(8, 1), ("fsdp", "ep"))
    res = mp.MeshResources(fsdp="fsdp", ep="ep", fsdp_dim="model")
    cfg = mp.MoEConfig(d_model=512,
                       d_ff=256,
                       num_experts=8,
                       kernel_backend="xla",
                       fp8="blockwise",
                       fp8_gemms="all")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jnp.ones((8, 4, 512))
    with pytest.raises(ValueError, match=r"shard has shape \(8, 64, 256\).*multiples of 128"):
        mp.moe_block(params, x, cfg, mesh=mesh, resources=res)
    # with bf16 GEMMs in the rule the whole weight is gathered first: no block straddles
    auto = dataclasses.replace(cfg, fp8_gemms="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulation's notice
        y = jax.eval_shape(lambda p, x: mp.moe_block(p, x, auto, mesh=mesh, resources=res).y,
                           params, x)
    assert y.shape == x.shape
