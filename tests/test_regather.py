"""MoEConfig.regather_rows and ops.regathered_gemms: the gate and up projections over permuted
rows whose backward permutes x again instead of keeping the rows. CPU: the op against a float64
loop reference, the residuals the block keeps, the block against today's path on one device and
on a mesh, the lowering for CUDA; GPU: the block on the kernels."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from configs import experiments
from moe_praxis import ops
from moe_praxis.ops import backend
from moe_praxis.praxis import fields
from praxis import base_layer
from tests import praxis_layer_util as pl
from tests import kernel_reference as ref
from tests.grouped_gemm_util import _fake_device, cuda_module, loop_grads, loop_reference
from tests.moe_reference import block_inputs
from tests.testutil import poison, rel_err, seed as _seed

F32_TOL = 1e-5  # float32 GEMMs and sums against float64, K <= 64
BF16_TOL = 2e-2  # bf16 inputs, GEMMs and outputs against float64 on the same (rounded) values


def _dispatch(t, k, e, pattern, rng):
    """(row_map [R], group_sizes [E]) of one expert sort (kernel_reference.expert_sort): rows
    sorted by expert, copies not kept at the end (row_map T), group sizes summing to the kept."""
    keys = ref.expert_sort_keys(t, k, e, pattern, rng)
    _, _, row_map, sizes = ref.expert_sort(keys, e, k)
    return row_map, sizes


def _want(x, row_map, ws, sizes, douts):
    """float64 loop reference: the outputs, dx and each weight's gradient of
    sum_i sum(outs[i] * douts[i])."""
    t = x.shape[0]
    rows = ref.permute(x, row_map)
    outs = [loop_reference(rows, w, sizes) for w in ws]
    drows, dws = zip(*(loop_grads(rows, w, sizes, d) for w, d in zip(ws, douts)))
    return outs, ref.unpermute(sum(drows), row_map, t), list(dws)


def _grads(x, row_map, ws, sizes, douts, backend_):

    def loss(x, ws):
        outs = ops.regathered_gemms(x,
                                    jnp.asarray(row_map),
                                    ws,
                                    jnp.asarray(sizes),
                                    backend=backend_)
        return sum(jnp.sum(o.astype(jnp.float32) * d) for o, d in zip(outs, douts)), outs

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, tuple(ws))


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "one", "empty", "dropped"])
@pytest.mark.parametrize("n", [1, 2])
def test_regathered_gemms_against_float64(pattern, n):
    """float32 on 'xla': the outputs, dx and every weight's gradient against the float64 loop,
    with skewed and empty groups, one expert holding every row, and copies not kept (row_map
    T: zero rows that get no gradient)."""
    s = _seed()
    rng = np.random.default_rng(s)
    t, k, e, m, h = 37, 3, 6, 24, 40
    row_map, sizes = _dispatch(t, k, e, pattern, rng)
    x = jnp.asarray(rng.standard_normal((t, m)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((e, m, h)), jnp.float32) for _ in range(n)]
    douts = [jnp.asarray(rng.standard_normal((t * k, h)), jnp.float32) for _ in range(n)]
    (_, outs), (dx, dws) = _grads(x, row_map, ws, sizes, douts, "xla")
    want_outs, want_dx, want_dws = _want(x, row_map, ws, sizes, douts)
    tag = f"seed={s} pattern={pattern} n={n}"
    for got, want in zip(outs, want_outs):
        assert rel_err(got, want) <= F32_TOL, tag
    assert rel_err(dx, want_dx) <= F32_TOL, tag
    for got, want in zip(dws, want_dws):
        assert rel_err(got, want) <= F32_TOL, tag
    kept = int(np.sum(sizes))
    assert not np.any(np.asarray(outs[0])[kept:]), tag  # rows past the groups: zeros


def test_regathered_gemms_on_the_cuda_path_against_float64(monkeypatch):
    """bf16 with the CUDA wiring on this GPU-less host (a faked Hopper GPU: every kernel lowers to
    its reference on the CPU): the same results as the float64 loop on the rounded inputs."""
    _fake_device(monkeypatch, 90, name="NVIDIA H100 80GB HBM3")
    s = _seed()
    rng = np.random.default_rng(s)
    t, k, e, m, h = 40, 4, 8, 64, 96
    row_map, sizes = _dispatch(t, k, e, "skewed", rng)
    x = jnp.asarray(rng.standard_normal((t, m)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((e, m, h)), jnp.bfloat16) for _ in range(2)]
    douts = [jnp.asarray(rng.standard_normal((t * k, h)), jnp.bfloat16) for _ in range(2)]
    (_, outs), (dx, dws) = _grads(x, row_map, ws, sizes, douts, "cuda")
    want_outs, want_dx, want_dws = _want(x, row_map, ws, sizes, douts)
    assert dx.dtype == jnp.bfloat16 and all(d.dtype == jnp.bfloat16 for d in dws)
    for got, want in zip(list(outs) + [dx] + list(dws), want_outs + [want_dx] + want_dws):
        assert rel_err(got, want) <= BF16_TOL, f"seed={s}"


def test_lowered_for_cuda_the_backward_permutes_again_and_unpermutes_each_dgrad(monkeypatch):
    """Lowered for CUDA: two permutes (the forward's and the backward's), one plain unpermute per
    weight (no two-input unpermute of both), three grouped GEMMs per weight, and the optimization
    barriers that order the backward."""
    _fake_device(monkeypatch, 90, name="NVIDIA H100 80GB HBM3")
    t, k, e, m, h = 64, 4, 8, 128, 256
    row_map = jnp.asarray(np.arange(t * k) % t, jnp.int32)
    sizes = jnp.full((e, ), t * k // e, jnp.int32)
    ws = tuple(jnp.zeros((e, m, h), jnp.bfloat16) for _ in range(2))

    def loss(x, ws):
        outs = ops.regathered_gemms(x, row_map, ws, sizes, backend="cuda")
        return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)

    text = cuda_module(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                       jnp.zeros((t, m), jnp.bfloat16), ws)
    calls = re.findall(r"custom_call @(moe_\w+)\(", text)
    assert calls.count("moe_permute") + calls.count("moe_permute_indexed") == 2, calls
    unpermutes = [c for c in calls if c.startswith("moe_unpermute")]
    assert len(unpermutes) == 2, calls
    assert "two = true" not in text
    for op in ("fwd", "dgrad", "wgrad"):
        assert calls.count(f"moe_grouped_gemm_{op}") == 2, (op, calls)
    assert text.count("optimization_barrier") >= 3


def _fused_case(rng, t, k, e, m, h, dtype):
    row_map, sizes = _dispatch(t, k, e, "skewed", rng)
    x = jnp.asarray(rng.standard_normal((t, m)), dtype)
    w = jnp.asarray(rng.standard_normal((e, m, 2 * h)) / np.sqrt(m), dtype)
    rw = jnp.asarray(rng.random(t * k), jnp.float32)
    dact = jnp.asarray(rng.standard_normal((t * k, h)), jnp.float32)
    return jnp.asarray(row_map), jnp.asarray(sizes), x, w, rw, dact


def _fused_grads(f, x, w, rw, dact):

    def loss(x, w, rw):
        act = f(x, w, rw)
        return jnp.sum(act.astype(jnp.float32) * dact), act

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, rw)


def _fused_reference(row_map, sizes, dact, x, w, rw):
    """float32 autodiff of the reference composition (permute, ragged_dot, SwiGLU), on x, w as
    given (rounded where they are bf16)."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

    def ref(x, w, rw):
        rows = ops.permute_reference(x, row_map)
        return ops.gate_up.gate_up_swiglu_reference(rows, w, sizes, rw)[2]

    return _fused_grads(ref, f32(x), f32(w), rw, dact)


@pytest.mark.parametrize("path", ["xla", "cuda", "cuda-sm80"])
def test_gate_up_swiglu_regathered_against_the_reference(path, monkeypatch):
    """The fused gate/up + SwiGLU over permuted rows, gathered again in its backward (skewed
    groups, some copies not kept, routing weights): act and the gradients of x, w_gate_up and
    the routing weights against float32 autodiff of the reference composition; 'xla' in float32
    within 1e-5, 'cuda' (the CUDA wiring on a faked Hopper GPU, every kernel lowered to its
    reference on the CPU) in bf16 within 2e-2; 'cuda-sm80' (a faked A100: no fused kernel, so
    ops.regathered_gemms against w_gate_up, then the SwiGLU, with a warning) the same."""
    backend.reset_warnings()
    if path != "xla":
        sm80 = path == "cuda-sm80"
        _fake_device(monkeypatch,
                     80 if sm80 else 90,
                     name="NVIDIA A100-SXM4-80GB" if sm80 else "NVIDIA H100 80GB HBM3")
    s = _seed()
    dtype, tol = (jnp.float32, F32_TOL) if path == "xla" else (jnp.bfloat16, BF16_TOL)
    row_map, sizes, x, w, rw, dact = _fused_case(np.random.default_rng(s), 40, 4, 8, 64, 48, dtype)

    def run(x, w, rw):
        return ops.gate_up_swiglu_regathered(x,
                                             row_map,
                                             w,
                                             sizes,
                                             rw,
                                             backend="xla" if path == "xla" else "cuda")

    if path == "cuda-sm80":
        with pytest.warns(UserWarning, match="gate_up_swiglu runs unfused"):
            (_, act), grads = _fused_grads(run, x, w, rw, dact)
    else:
        (_, act), grads = _fused_grads(run, x, w, rw, dact)
    (_, want_act), want = _fused_reference(row_map, sizes, dact, x, w, rw)
    assert act.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype
    for got, ref_ in zip((act, ) + tuple(grads), (want_act, ) + tuple(want)):
        assert rel_err(got, ref_) <= tol, f"seed={s} {path}"


def test_gate_up_swiglu_regathered_names_a_bad_operand():
    """Each operand of the wrong shape is a one-line error naming it and what would be valid."""
    x, w = jnp.zeros((8, 16), jnp.float32), jnp.zeros((2, 16, 12), jnp.float32)
    row_map, sizes = jnp.arange(10) % 8, jnp.array([6, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"needs x \[T, M\], row_map \[R\]"):
        ops.gate_up_swiglu_regathered(x, row_map[:, None], w, sizes)
    with pytest.raises(ValueError, match=r"needs x \[T, M\]"):
        ops.gate_up_swiglu_regathered(x[:, :8], row_map, w, sizes)
    with pytest.raises(ValueError, match="must be even"):
        ops.gate_up_swiglu_regathered(x, row_map, w[..., :11], sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be \[E=2\]"):
        ops.gate_up_swiglu_regathered(x, row_map, w, sizes[:1])
    with pytest.raises(ValueError, match=r"row_weights must be \[R=10\], got \(8,\)"):
        ops.gate_up_swiglu_regathered(x, row_map, w, sizes, jnp.ones((8, )))


def test_lowered_for_cuda_the_fused_backward_permutes_again(monkeypatch):
    """gate_up_swiglu_regathered lowered for CUDA: the fused forward kernel, two permutes (the
    forward's and the backward's), one wgrad, one dgrad and one unpermute of it."""
    _fake_device(monkeypatch, 90, name="NVIDIA H100 80GB HBM3")
    t, k, e, m, h = 64, 4, 8, 128, 128
    row_map = jnp.asarray(np.arange(t * k) % t, jnp.int32)
    sizes = jnp.full((e, ), t * k // e, jnp.int32)

    def loss(x, w):
        act = ops.gate_up_swiglu_regathered(x, row_map, w, sizes, backend="cuda")
        return jnp.sum(act.astype(jnp.float32))

    text = cuda_module(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                       jnp.zeros((t, m), jnp.bfloat16), jnp.zeros((e, m, 2 * h), jnp.bfloat16))
    calls = re.findall(r"custom_call @(moe_\w+)\(", text)
    assert calls.count("moe_grouped_gemm_swiglu_fwd") == 1, calls
    assert calls.count("moe_permute") + calls.count("moe_permute_indexed") == 2, calls
    assert len([c for c in calls if c.startswith("moe_unpermute")]) == 1, calls
    for op in ("dgrad", "wgrad"):
        assert calls.count(f"moe_grouped_gemm_{op}") == 1, (op, calls)


def _block_step(cfg, params, x, cot, **kw):

    def loss(params, x):
        o = mp.moe_block(params, x, cfg, **kw)
        return jnp.sum(o.y.astype(jnp.float32) * cot) + o.aux_loss, o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


def _saved_shapes(cfg, params, x, capsys):

    def f(params, x):
        return jnp.sum(mp.moe_block(params, x, cfg).y.astype(jnp.float32))

    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(f, params, x)
    return re.findall(r"\w+\[([\d,]+)\]", capsys.readouterr().out)


@pytest.mark.parametrize("fields", [dict(), dict(gated=False), dict(fuse_gate_up=True)])
def test_block_keeps_no_rows_for_the_backward(fields, capsys):
    """The residuals moe_block keeps for its backward: with regather_rows no [R, M] array (the
    rows) and x [T, M]; without it the rows are kept (the test can fail)."""
    t, k, m = 64, 4, 32
    cfg = mp.MoEConfig(d_model=m, d_ff=48, num_experts=8, top_k=k, kernel_backend="xla", **fields)
    params, x, _ = block_inputs(cfg, (t, m), _seed())
    rows = f"{t * k},{m}"
    assert rows in _saved_shapes(cfg, params, x, capsys)
    on = _saved_shapes(dataclasses.replace(cfg, regather_rows=True), params, x, capsys)
    assert rows not in on and f"{t},{m}" in on, on


@pytest.mark.parametrize("fields", [
    dict(),
    dict(gated=False),
    dict(fuse_swiglu_bwd=True),
    dict(capacity_factor=1.0),
    dict(gather_combine=True),
    dict(fuse_gate_up=True),
])
def test_block_with_regather_rows_matches_todays_path(fields):
    """float32 on 'xla': y, the aux loss, the counts and every gradient with regather_rows equal
    the default path within 1e-5 (the dgrads' unpermutes are summed in another order)."""
    s = _seed()
    cfg = mp.MoEConfig(d_model=32, d_ff=48, num_experts=8, top_k=2, kernel_backend="xla", **fields)
    params, x, cot = block_inputs(cfg, (96, 32), s)
    on = dataclasses.replace(cfg, regather_rows=True)
    assert "dispatcher: regather" in mp.describe_plan(on, x)
    a, b = _block_step(cfg, params, x, cot), _block_step(on, params, x, cot)
    np.testing.assert_array_equal(a[0].tokens_per_expert, b[0].tokens_per_expert)
    np.testing.assert_array_equal(a[0].dropped_tokens, b[0].dropped_tokens)
    for u, v in zip(jax.tree.leaves((a[0].y, a[0].aux_loss, a[1])),
                    jax.tree.leaves((b[0].y, b[0].aux_loss, b[1]))):
        assert rel_err(v, u) <= F32_TOL, f"seed={s} {fields}"


MESHES = {  # name: (shape, axis names, MeshResources fields)
    "dp2xfsdp2xtp2": ((2, 2, 2), ("dp", "fsdp", "tp"), dict(dp="dp", fsdp="fsdp", tp="tp")),
    "fsdp4xtp2": ((4, 2), ("fsdp", "tp"), dict(fsdp="fsdp", tp="tp")),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_block_with_regather_rows_on_a_mesh_equals_one_device(mesh_name):
    """On 8 CPU devices (dp, fsdp, tp: tp splits d_ff, so each shard's dx is a partial sum) the
    block with regather_rows gives one device's default results within 1e-5."""
    s = _seed()
    cfg = mp.MoEConfig(d_model=32, d_ff=64, num_experts=8, top_k=2, kernel_backend="xla")
    params, x, cot = block_inputs(cfg, (4, 16, 32), s)
    want = _block_step(cfg, params, x, cot)
    shape, names, kw = MESHES[mesh_name]
    mesh = Mesh(np.array(jax.devices("cpu")[:math.prod(shape)]).reshape(shape), names)
    got = _block_step(dataclasses.replace(cfg, regather_rows=True),
                      params,
                      x,
                      cot,
                      mesh=mesh,
                      resources=mp.MeshResources(**kw))
    for u, v in zip(jax.tree.leaves((want[0].y, want[0].aux_loss, want[1])),
                    jax.tree.leaves((got[0].y, got[0].aux_loss, got[1]))):
        assert rel_err(v, u) <= F32_TOL, f"seed={s} mesh={mesh_name}"


def test_regather_rows_with_fp8_or_the_fully_fused_experts_is_an_error():
    base = dict(d_model=128, d_ff=128, num_experts=4, regather_rows=True)
    for extra in (dict(fuse_gate_up=True, fuse_swiglu_bwd=True), dict(fp8="blockwise")):
        with pytest.raises(ValueError, match=r"regather_rows.*needs fp8=None and not both"):
            mp.MoEConfig(**base, **extra)
    assert mp.MoEConfig(**base, fuse_gate_up=True).regather_rows


def test_regather_rows_under_expert_parallelism_warns_and_keeps_the_rows():
    """ep 2: the rows are the exchange's; the plan keeps them (dispatcher 'permute') and says
    why in a warning, and the results equal the same mesh without the flag."""
    backend.reset_warnings()
    s = _seed()
    cfg = mp.MoEConfig(d_model=32, d_ff=48, num_experts=8, top_k=2, kernel_backend="xla")
    params, x, cot = block_inputs(cfg, (4, 16, 32), s)
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "ep"))
    res = mp.MeshResources(dp="dp", ep="ep")
    on = dataclasses.replace(cfg, regather_rows=True)
    with pytest.warns(RuntimeWarning, match="regather_rows has no effect under expert paral"):
        plan = mp.describe_plan(on, x, mesh=mesh, resources=res)
    assert "dispatcher: permute" in plan
    a = _block_step(cfg, params, x, cot, mesh=mesh, resources=res)
    b = _block_step(on, params, x, cot, mesh=mesh, resources=res)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), f"seed={s}")


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fields",
    [dict(), dict(fuse_swiglu_bwd=True),
     dict(gated=False),
     dict(fuse_gate_up=True)])
def test_block_cuda_with_regather_rows_matches_xla(fields):
    """moe_block on 'cuda' with regather_rows (bf16, skewed by the router's draw, some experts
    empty at E=32 and T=600) against 'xla' with it and 'cuda' without it: y and every gradient
    within bf16's 2e-2; poisoned memory first, so rows the kernels leave unwritten show as NaN."""
    info = ops.backend_info()["cuda"]
    if not info["usable"]:
        pytest.skip(f"CUDA kernels not usable here: {info['reason']}")
    s = _seed()
    cfg = mp.MoEConfig(d_model=256,
                       d_ff=192,
                       num_experts=32,
                       top_k=4,
                       kernel_backend="cuda",
                       regather_rows=True,
                       **fields)
    params, x, cot = block_inputs(cfg, (600, 256), s, jnp.bfloat16, jnp.bfloat16)
    poison()
    got = _block_step(cfg, params, x, cot)
    for other in (dataclasses.replace(cfg, kernel_backend="xla"),
                  dataclasses.replace(cfg, regather_rows=False)):
        want = _block_step(other, params, x, cot)
        for u, v in zip(jax.tree.leaves((got[0].y, got[1])), jax.tree.leaves((want[0].y, want[1]))):
            assert rel_err(u, v) <= BF16_TOL, f"seed={s} {fields} against {other}"


def test_the_praxis_layer_field_and_the_experiment_knob_reach_the_block():
    """MoEFeedForward.regather_rows is MoEConfig's, and the experiments' REGATHER_ROWS knob sets
    it: the layer's output equals the default layer's (float32, 1e-5)."""
    tpl = pl._moe_tpl(gating_func="topk", use_gated_activation=True)
    on = pl._moe_tpl(gating_func="topk", use_gated_activation=True, regather_rows=True)
    assert fields.build_config(base_layer.instantiate(on)).regather_rows
    assert not fields.build_config(base_layer.instantiate(tpl)).regather_rows
    x, pad = pl._inputs(_seed(), pad_from=3)
    variables = pl._init_layer(tpl, x, pad)
    want, got = pl._run_layer(tpl, variables, x, pad)[0], pl._run_layer(on, variables, x, pad)[0]
    assert rel_err(got, want) <= F32_TOL
    assert "regather_rows" in experiments.MOE_KNOBS
    assert experiments.LanguageModel.REGATHER_ROWS is False
