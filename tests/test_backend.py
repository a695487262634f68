"""Backend selection, the kernel library loader, and the CUDA primitives' shared code path,
on the CPU (no GPU needed): every op family's CUDA path (`*_cuda`) runs its platform_dependent
default branch (the reference) here, through the same custom_vjp the GPU uses."""

import importlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_praxis as mp
from moe_praxis import build_kernels, ops, routing
from moe_praxis.config import MoEConfig
from moe_praxis.ops import backend
from moe_praxis.ops.router import router_unsupported
from moe_praxis.ops.permute import permute_cuda, permute_unsupported, unpermute_cuda
from moe_praxis.ops.swiglu import swiglu_cuda, swiglu_unsupported

aux_loss_cuda = importlib.import_module("moe_praxis.ops.aux_loss").aux_loss_cuda
from tests import kernel_reference as ref

REPO = Path(__file__).resolve().parent.parent
F32_TOL = 1e-6


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_no_gpu = pytest.mark.skipif(_has_gpu(), reason="checks the behaviour without a GPU")


def test_backend_info_lists_every_backend_with_a_reason():
    info = ops.backend_info()
    assert set(info) == {"xla", "cuda", "fp8_gemms"}
    assert info["xla"]["usable"] is True
    for name in ("xla", "cuda"):
        assert isinstance(info[name]["usable"], bool) and info[name]["reason"], name
    assert info["cuda"]["library"] == str(backend.library_path())
    assert info["fp8_gemms"]["rule"]["rule"].endswith("fp8_gemm_rule")


@needs_no_gpu
def test_cuda_unusable_without_gpu_and_auto_falls_back():
    info = ops.backend_info()["cuda"]
    assert info["usable"] is False and "no GPU" in info["reason"]
    for op in ("router", "swiglu", "permute", "aux_loss", "grouped_gemm", ""):
        assert ops.resolve_backend("auto", op) == "xla"
        assert ops.resolve_backend("xla", op) == "xla"


@needs_no_gpu
def test_cuda_requested_without_gpu_raises_clear_error():
    with pytest.raises(RuntimeError,
                       match=r"kernel_backend='cuda' requested for swiglu but no GPU"):
        ops.resolve_backend("cuda", "swiglu")
    x = jnp.ones((4, 8))
    with pytest.raises(RuntimeError, match="no GPU"):
        ops.swiglu(x, x, backend="cuda")
    cfg = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2, kernel_backend="cuda")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    with pytest.raises(RuntimeError, match="kernel_backend='cuda' requested for moe_block"):
        mp.moe_block(params, jnp.ones((3, 8)), cfg)


def test_invalid_backend_names_value_and_choices():
    with pytest.raises(ValueError, match=r"kernel_backend='tpu' is invalid; valid: \('auto'"):
        ops.resolve_backend("tpu", "router")


def test_missing_library_reason_names_path_and_env_var(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "libmoe_praxis_kernels.so"
    monkeypatch.setenv(backend.ENV_LIB, str(missing))
    try:
        assert backend.library_path() == missing
        assert build_kernels.library_path() == missing
        ok, why = backend.load_library(force=True)
        assert not ok
        assert str(missing) in why and "MOE_PRAXIS_KERNEL_LIB" in why
        assert "python -m moe_praxis.build_kernels" in why
        assert backend.library_status() == (False, why)
    finally:
        monkeypatch.delenv(backend.ENV_LIB)
        backend.load_library(force=True)


def test_unloadable_library_gives_reason(tmp_path):
    bad = tmp_path / "libmoe_praxis_kernels.so"
    bad.write_bytes(b"not an ELF file")
    try:
        ok, why = backend.load_library(bad)
        assert not ok and "cannot open" in why and str(bad) in why
    finally:
        backend.load_library(force=True)


def test_default_library_location_and_env_var_documented():
    """Docs and code in step: the env var and default path are what the code reads."""
    assert backend.ENV_LIB == build_kernels.ENV_LIB == "MOE_PRAXIS_KERNEL_LIB"
    assert backend.DEFAULT_LIB == build_kernels.DEFAULT_LIB
    assert backend.DEFAULT_LIB == REPO / "moe_praxis" / "lib" / "libmoe_praxis_kernels.so"
    doc = (REPO / "docs" / "kernels.md").read_text()
    assert "MOE_PRAXIS_KERNEL_LIB" in doc and "moe_praxis/lib/libmoe_praxis_kernels.so" in doc
    assert "python -m moe_praxis.build_kernels" in doc
    # every kernel in the one table is documented (here or on its own docs page)
    all_docs = "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    for name in backend.KERNELS:
        assert f"`{name}`" in all_docs, f"no docs/*.md lists the FFI target {name}"
    # the build's env var is read by the code (no documented-but-unread variables)
    src = (REPO / "moe_praxis" / "ops" / "_library.py").read_text()
    assert "os.environ.get(ENV_LIB)" in src


def test_every_table_symbol_is_defined_in_a_kernel_source():
    defined = set()
    for src in (REPO / "kernels").glob("*.cu"):
        defined |= set(re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", src.read_text()))
    missing = sorted(set(backend.KERNELS.values()) - defined)
    assert not missing, f"KERNELS symbols with no XLA_FFI_DEFINE_HANDLER_SYMBOL: {missing}"


def test_ffi_helper_rejects_unknown_target():
    with pytest.raises(KeyError, match="not in moe_praxis.ops.backend.KERNELS"):
        backend.ffi("moe_nope", jax.ShapeDtypeStruct((), jnp.float32))


def _router_unsupported(num_experts, cfg):
    return router_unsupported(num_experts, cfg.top_k, cfg.num_expert_groups)


def test_unsupported_shapes_name_the_reason():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=1024, top_k=16)
    assert "num_experts=1024" in _router_unsupported(1024, cfg)
    assert _router_unsupported(64, MoEConfig(d_model=8, d_ff=8, num_experts=64, top_k=8)) == ""
    grouped = MoEConfig(d_model=8,
                        d_ff=8,
                        num_experts=64,
                        top_k=8,
                        num_expert_groups=8,
                        group_topk=4)
    assert _router_unsupported(64, grouped) == ""  # group-limited top-k runs in the kernel
    assert "num_expert_groups=64" in _router_unsupported(
        64, MoEConfig(d_model=8, d_ff=8, num_experts=64, top_k=1, num_expert_groups=64))
    x = jnp.ones((4, 8))
    assert "act='gelu'" in swiglu_unsupported(x, "gelu")
    assert "float16" in swiglu_unsupported(x.astype(jnp.float16), "silu")
    assert swiglu_unsupported(x, "silu") == ""
    assert "float16" in permute_unsupported(x.astype(jnp.float16), jnp.zeros(3, jnp.int32))


# ------------------------------------------------- the CUDA primitives' code path on the CPU


def test_route_logits_backend_switch_on_cpu():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=16, top_k=2)
    logits = jax.random.normal(jax.random.key(ref.seed()), (11, 16))
    a = routing.route_logits(logits, cfg, backend="auto")
    b = routing.route_logits_reference(logits, cfg)
    np.testing.assert_array_equal(np.asarray(a.expert_ids), np.asarray(b.expert_ids))


def test_swiglu_permute_aux_paths_match_numpy_reference():
    s = ref.seed()
    rng = np.random.default_rng(s)
    gate = jnp.asarray(rng.standard_normal((33, 24)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((33, 24)), jnp.float32)
    w = jnp.asarray(rng.random(33), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((33, 24)), jnp.float32)
    assert ref.rel_err(swiglu_cuda(gate, up, w), ref.swiglu(gate, up, w)) <= F32_TOL
    assert ref.rel_err(swiglu_cuda(gate, up), ref.swiglu(gate, up)) <= F32_TOL
    g = jax.grad(lambda a, b, c: jnp.sum(swiglu_cuda(a, b, c) * dout), argnums=(0, 1, 2))(gate, up,
                                                                                          w)
    for got, want in zip(g, ref.swiglu_grads(gate, up, w, dout)):
        assert ref.rel_err(got, want) <= F32_TOL
    t, k = 17, 3
    row_map = jnp.asarray(ref.row_map_for(t, k, 8, rng))
    x = jnp.asarray(rng.standard_normal((t, 5)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((t * k, 5)), jnp.float32)
    np.testing.assert_allclose(permute_cuda(x, row_map), ref.permute(x, row_map), rtol=1e-7)
    assert ref.rel_err(unpermute_cuda(y, row_map, t), ref.unpermute(y, row_map, t)) <= F32_TOL
    cy = jnp.asarray(rng.standard_normal((t * k, 5)), jnp.float32)
    gx = jax.grad(lambda a: jnp.sum(permute_cuda(a, row_map) * cy))(x)
    assert ref.rel_err(gx, ref.unpermute(cy, row_map, t)) <= F32_TOL
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((40, 8)), jnp.float32))
    f = jnp.asarray(rng.integers(0, 20, 8), jnp.int32)
    got = aux_loss_cuda(probs, f, jnp.asarray(40), 2, 0.3)
    assert abs(float(got) - ref.aux_loss(probs, f, top_k=2, coeff=0.3)) <= 1e-6 * float(got)


def test_permute_references_read_and_drop_negative_rows_as_the_kernels_do():
    """Out-of-range row_map entries, negative ones too, read zeros and are not written (the
    kernels' contract); jnp indexing alone would wrap -1 to the last token."""
    rng = np.random.default_rng(ref.seed())
    t = 6
    row_map = jnp.asarray([-1, -3, 0, t, 5, -2, t + 2, 2], jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, 4)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    np.testing.assert_array_equal(ops.permute_reference(x, row_map), ref.permute(x, row_map))
    np.testing.assert_allclose(ops.unpermute_reference(y, row_map, t),
                               ref.unpermute(y, row_map, t),
                               rtol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_custom_vjp_inside_shard_map_with_mixed_varying_inputs(weighted):
    """Inside shard_map (check_vma) the rows vary over the mesh axis and the weights do not
    (or there are none): the CUDA path's custom_vjp (the same structure on the CPU, whose
    reference runs in place of the FFI call) must return cotangents of its inputs' types; the
    weights' gradient is summed over the shards."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]), ("x", ))
    s = ref.seed()
    rng = np.random.default_rng(s)
    gate, up, dout = (jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.random(8), jnp.float32)  # the same [8] weights on every shard

    def local(g, u, d, ww):
        out = swiglu_cuda(g[0], u[0], ww if weighted else None)
        return jnp.sum(out * d[0])

    def loss(g, u, ww):
        per = jax.shard_map(lambda a, b, c, v: local(a, b, c, v)[None],
                            mesh=mesh,
                            in_specs=(P("x"), P("x"), P("x"), P()),
                            out_specs=P("x"))(g, u, dout, ww)
        return jnp.sum(per)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(gate, up, w)
    want = [np.zeros((4, 8, 16)), np.zeros((4, 8, 16)), np.zeros(8)]
    for i in range(4):
        wi = w if weighted else np.ones(8)
        dg, du, dw = ref.swiglu_grads(gate[i], up[i], wi, dout[i])
        want[0][i], want[1][i] = dg, du
        want[2] += np.asarray(dw) if weighted else 0.0
    assert ref.rel_err(got[0], want[0]) <= F32_TOL and ref.rel_err(got[1], want[1]) <= F32_TOL
    if weighted:
        assert ref.rel_err(got[2], want[2]) <= F32_TOL, f"seed={s}"
    else:
        np.testing.assert_array_equal(np.asarray(got[2]), 0.0)


def _aux_sharded(mesh_shape, axes, spec):
    mesh = jax.make_mesh(mesh_shape, axes)
    t, e, k = 64, 16, 2
    s = ref.seed()
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(s), (t, e)), -1)
    f = jax.random.randint(jax.random.key(s + 1), (e, ), 0, 9)
    probs = jax.device_put(probs, NamedSharding(mesh, spec))
    fn = jax.jit(jax.value_and_grad(lambda p: 1.5 * aux_loss_cuda(p, f, jnp.asarray(t), k, 0.2)))
    return fn, probs, f, (t, e, k)


@pytest.mark.parametrize("spec", [P(("dp", "ep"), None), P("dp", "ep")])
def test_aux_loss_jit_grad_sharded_on_cpu_mesh(spec):
    """jit(grad) over a sharded probs runs the custom_partitioning rule under Shardy."""
    fn, probs, f, (t, e, k) = _aux_sharded((4, 2), ("dp", "ep"), spec)
    val, g = fn(probs)
    assert abs(float(val) - 1.5 * ref.aux_loss(probs, f, top_k=k, coeff=0.2)) <= 1e-6 * float(val)
    want = 1.5 * 0.2 * e / (k * t * t) * np.broadcast_to(np.asarray(f, np.float64), (t, e))
    assert ref.rel_err(g, want) <= F32_TOL
    assert g.sharding.is_equivalent_to(probs.sharding, 2), (g.sharding, probs.sharding)


def test_aux_loss_sharded_lowering_for_cuda_keeps_cotangent_rank0():
    """Lowered for CUDA (no GPU needed), the backward's Shardy rule takes a rank-0 cotangent."""
    assert jax.config.jax_use_shardy_partitioner
    fn, probs, _, (t, e, _) = _aux_sharded((4, 2), ("dp", "ep"), P(("dp", "ep"), None))
    text = fn.trace(probs).lower(lowering_platforms=("cuda", )).as_text()
    rules = re.findall(r"sdy\.op_sharding_rule<\(([^)]*)\)->\(([^)]*)\)", text)
    assert ("[], [i, j], [j], []", "[i, j]") in rules, rules  # bwd: g [] , probs, f, scale []
    assert ("[i, j], [j], []", "[]") in rules, rules  # fwd: loss [] reduced over i, j
    # the counts f go to the kernel as they are (int32 here, float32 when given as floats)
    assert re.search(rf"\(tensor<f32>, tensor<{t}x{e}xf32>, tensor<{e}x(f32|i32)>, tensor<f32>\)",
                     text), text[-2000:]


def test_call_stats_says_why_without_library(tmp_path):
    missing = tmp_path / "lib.so"
    try:
        ok, why = backend.load_library(missing)
        assert not ok and str(missing) in why
        with pytest.raises(RuntimeError, match=f"not built: {re.escape(str(missing))}"):
            backend.call_stats()
    finally:
        backend.load_library(force=True)


def test_call_stats_reads_the_counters_when_loaded():
    state = backend.library_state()
    if not state["loaded"]:
        pytest.skip(f"kernel library not loaded here: {state['reason']}")
    stats = backend.call_stats()
    assert set(stats) == {"calls", "captured"}
    assert 0 <= stats["captured"] <= stats["calls"]
