"""The choice of grouped GEMM kernel by device capability: the sm_80 one (CUTLASS 2.x
GemmGrouped) or the Hopper one, on the CPU with a faked device (compute capability, library
loaded, JAX on a GPU; tests/grouped_gemm_util.py).

The kernel family and every op's backend, MOE_PRAXIS_GROUPED_GEMM and backend.force_grouped_gemm,
and, lowered for CUDA on the CPU (jax.export), which FFI targets a faked A100 or Hopper GPU would
run (the grouped GEMM's fwd / dgrad / wgrad, the whole moe_block, the unfused gate/up path, whose
result is checked against the fused op's reference); the warning that ragged_dot on a GPU computes
E times the useful work. Inputs are fresh random draws every run (the seed is printed on failure).
"""

import dataclasses
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops import backend
from tests.grouped_gemm_util import REPO, RTOL_16, _fake_device, _inputs, cuda_module
from tests.testutil import rel_err
from tests.testutil import seed as _seed

gate_up = importlib.import_module("moe_praxis.ops.gate_up")


@pytest.mark.parametrize("cc,kernel", [(80, "sm80"), (86, "sm80"), (89, "sm80"), (90, "sm90"),
                                       (91, "sm80"), (100, "sm80"), (120, "sm80")])
def test_grouped_gemm_kernel_by_compute_capability(monkeypatch, cc, kernel):
    """9.0 runs the Hopper kernels; 8.x, a 9.x where sm_90a code cannot run, and GPUs past
    Hopper (through the compute_80 PTX) the sm_80 ones; fp16 inputs take the sm_80 kernels on
    Hopper too (the Hopper ones are bf16)."""
    _fake_device(monkeypatch, cc)
    assert backend.grouped_gemm_kernel()[0] == kernel
    assert backend.grouped_gemm_kernel(dtype=jnp.bfloat16)[0] == kernel
    assert backend.grouped_gemm_kernel(dtype=jnp.float16)[0] == "sm80"
    assert backend.op_backend("cuda", "grouped_gemm") == "cuda"
    assert backend.resolve_backend("auto", "grouped_gemm") == "cuda"
    info = backend.backend_info()["cuda"]["ops"]
    assert info["grouped_gemm"]["kernel"] == kernel
    assert f"{cc // 10}.{cc % 10}" in info["grouped_gemm"]["reason"]
    for op in ("router", "swiglu", "permute", "aux_loss"):
        assert info[op]["kernel"] == "cuda", (op, info[op])
    fused = info["gate_up_swiglu"]
    assert fused["kernel"] == ("sm90" if kernel == "sm90" else "unfused"), fused
    if kernel == "sm80":
        assert "unfused path runs" in fused["reason"], fused


def test_below_sm80_no_kernel_and_auto_falls_back(monkeypatch):
    _fake_device(monkeypatch, 75, "Tesla T4")
    assert backend.resolve_backend("auto", "grouped_gemm") == "xla"
    with pytest.raises(RuntimeError,
                       match=r"needs compute capability >= 8\.0.*'Tesla T4' has 7\.5"):
        backend.resolve_backend("cuda", "grouped_gemm")
    info = backend.backend_info()["cuda"]["ops"]
    assert {e["kernel"] for e in info.values()} == {"xla"}, info


def test_env_var_forces_the_kernel_family(monkeypatch):
    """MOE_PRAXIS_GROUPED_GEMM=sm80 forces the sm_80 kernels on a Hopper GPU (and turns the
    fused gate/up into the unfused path, saying so); =sm90 elsewhere makes the grouped GEMM
    unusable with a reason; other values are errors naming the valid ones."""
    _fake_device(monkeypatch, 90, "NVIDIA H200")
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "sm80")
    kernel, why = backend.grouped_gemm_kernel()
    assert kernel == "sm80" and "MOE_PRAXIS_GROUPED_GEMM=sm80" in why
    info = backend.backend_info()["cuda"]["ops"]
    assert info["grouped_gemm"]["kernel"] == "sm80"
    assert info["gate_up_swiglu"]["kernel"] == "unfused"
    assert "MOE_PRAXIS_GROUPED_GEMM=sm80" in info["gate_up_swiglu"]["reason"]
    assert backend.cuda_status("gate_up_swiglu")[0] is False
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, " SM80 ")
    assert backend.grouped_gemm_kernel()[0] == "sm80"
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "")
    assert backend.grouped_gemm_kernel()[0] == "sm90"
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "auto")
    assert backend.grouped_gemm_kernel()[0] == "sm90"
    _fake_device(monkeypatch, 80)
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "sm90")
    assert backend.requirement("grouped_gemm") == (90, 91)
    assert backend.resolve_backend("auto", "grouped_gemm") == "xla"
    with pytest.raises(RuntimeError, match=r"grouped_gemm kernel needs compute capability 9\.0"):
        backend.resolve_backend("cuda", "grouped_gemm")
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "ampere")
    with pytest.raises(ValueError,
                       match=r"MOE_PRAXIS_GROUPED_GEMM='ampere' is invalid; valid: \('auto'"):
        backend.grouped_gemm_kernel()


def test_force_grouped_gemm_scopes_the_family_to_what_is_traced_inside(monkeypatch):
    """backend.force_grouped_gemm('sm80') forces the sm_80 kernels (ahead of the environment
    variable) for what is traced inside the block only: a program lowered inside calls the
    sm_80 targets, one lowered after it the Hopper ones again; None changes nothing; other
    values are errors naming the valid ones."""
    _fake_device(monkeypatch, 90, "NVIDIA H200")
    lhs, rhs, gs, dout = _inputs(64, 16, 32, 4, "skewed", jnp.bfloat16, _seed())

    def fwd_and_grads(a, b):
        out, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, gs, backend="cuda"), a, b)
        return out, *vjp(dout)

    sm80_targets = {f"moe_grouped_gemm_sm80_{op}" for op in ("fwd", "dgrad", "wgrad")}
    with backend.force_grouped_gemm("sm80"):
        kernel, why = backend.grouped_gemm_kernel()
        assert kernel == "sm80" and "force_grouped_gemm=sm80" in why, why
        assert backend.backend_info()["cuda"]["ops"]["gate_up_swiglu"]["kernel"] == "unfused"
        assert set(_cuda_targets(fwd_and_grads, lhs, rhs)) == sm80_targets
        with backend.force_grouped_gemm(None):
            assert backend.grouped_gemm_kernel()[0] == "sm80"
    assert backend.grouped_gemm_kernel()[0] == "sm90"
    # a fresh function: jit reuses the trace of one traced before (the docstring's caveat)
    after = set(_cuda_targets(lambda a, b: fwd_and_grads(a, b), lhs, rhs))
    assert after == {f"moe_grouped_gemm_{op}" for op in ("fwd", "dgrad", "wgrad")}, after
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "sm80")
    with backend.force_grouped_gemm("auto"):
        assert backend.grouped_gemm_kernel()[0] == "sm90"
    assert backend.grouped_gemm_kernel()[0] == "sm80"
    with pytest.raises(ValueError, match=r"force_grouped_gemm\('ampere'\) is invalid; valid: "):
        with backend.force_grouped_gemm("ampere"):
            pass
    assert backend.grouped_gemm_kernel()[0] == "sm80"


def test_family_is_fixed_when_the_op_is_called_for_its_forward_and_backward(monkeypatch):
    """The kernel family is a static argument of the op, read when it is called: a backward
    traced after the force ended (or from a trace cache) runs the family of its forward, never
    the other one (fwd under force_grouped_gemm('sm80'), vjp applied outside: all sm_80)."""
    _fake_device(monkeypatch, 90, "NVIDIA H200")
    lhs, rhs, gs, dout = _inputs(64, 16, 32, 4, "balanced", jnp.bfloat16, _seed())

    def fwd_inside_bwd_outside(a, b):
        with backend.force_grouped_gemm("sm80"):
            out, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, gs, backend="cuda"), a, b)
        return out, *vjp(dout)

    def fwd_outside_bwd_inside(a, b):
        out, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, gs, backend="cuda"), a, b)
        with backend.force_grouped_gemm("sm80"):
            return out, *vjp(dout)

    tags = {"sm80": "sm80_", "sm90": ""}
    for fn, family in ((fwd_inside_bwd_outside, "sm80"), (fwd_outside_bwd_inside, "sm90")):
        got = set(_cuda_targets(fn, lhs, rhs))
        want = {f"moe_grouped_gemm_{tags[family]}{op}" for op in ("fwd", "dgrad", "wgrad")}
        assert got == want, (fn.__name__, got)


def test_env_var_is_read_in_one_place_and_documented():
    srcs = [p for p in (REPO / "moe_praxis").rglob("*.py") if "ENV_GROUPED_GEMM" in p.read_text()]
    assert [p.name for p in srcs] == ["backend.py"], srcs
    assert backend.ENV_GROUPED_GEMM == "MOE_PRAXIS_GROUPED_GEMM"
    assert "os.environ.get(ENV_GROUPED_GEMM" in (REPO / "moe_praxis/ops/backend.py").read_text()
    for doc in ("kernels.md", "grouped_gemm_sm80.md"):
        assert "MOE_PRAXIS_GROUPED_GEMM=sm80" in (REPO / "docs" / doc).read_text(), doc


def _cuda_targets(fn, *args):
    """The moe_praxis FFI targets (and their `tile` attributes) of fn lowered for CUDA."""
    return re.findall(r"custom_call @(moe_\w+)", cuda_module(jax.jit(fn), *args))


@pytest.mark.parametrize("cc,dtype,family", [(80, jnp.bfloat16, "sm80"), (86, jnp.float16, "sm80"),
                                             (90, jnp.bfloat16, "sm90"), (90, jnp.float16, "sm80")])
def test_lowered_for_cuda_the_chosen_family_runs_fwd_dgrad_wgrad(monkeypatch, cc, dtype, family):
    """Lowered for CUDA on the CPU: a faked A100 (or fp16 on a faked Hopper) lowers the sm_80
    FFI targets for the forward, dgrad and wgrad, a faked Hopper with bf16 the Hopper ones."""
    _fake_device(monkeypatch, cc)
    lhs, rhs, gs, dout = _inputs(64, 16, 32, 4, "skewed", dtype, _seed())

    def fwd_and_grads(a, b):
        out, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, gs, backend="cuda"), a, b)
        return out, *vjp(dout)

    targets = set(_cuda_targets(fwd_and_grads, lhs, rhs))
    tag = "sm80_" if family == "sm80" else ""
    assert targets == {f"moe_grouped_gemm_{tag}{op}" for op in ("fwd", "dgrad", "wgrad")}, targets


def test_lowered_for_cuda_moe_block_on_sm80_runs_sm80_kernels_and_unfused_gate_up(monkeypatch):
    """The whole block on a faked A100 lowers the sm_80 grouped GEMMs, the SwiGLU kernel and
    the other kernels; with fuse_gate_up the fused Hopper kernel is replaced by the unfused path
    (one warning saying why)."""
    _fake_device(monkeypatch, 80)
    cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=64, d_ff=128, kernel_backend="cuda")
    params = mp.init_moe_params(jax.random.key(_seed()), cfg)
    x = jnp.ones((2, 16, cfg.d_model), jnp.bfloat16)
    targets = set(_cuda_targets(lambda p, xx: mp.moe_block(p, xx, cfg).y, params, x))
    assert {"moe_grouped_gemm_sm80_fwd", "moe_swiglu_fwd", "moe_router_fwd",
            "moe_permute_indexed"} <= targets, targets
    assert not {"moe_grouped_gemm_fwd", "moe_grouped_gemm_swiglu_fwd"} & targets, targets
    fcfg = dataclasses.replace(cfg, fuse_gate_up=True, gated=True)
    fparams = mp.init_moe_params(jax.random.key(1), fcfg)
    with pytest.warns(UserWarning, match="gate_up_swiglu runs unfused.*Hopper"):
        targets = set(_cuda_targets(lambda p, xx: mp.moe_block(p, xx, fcfg).y, fparams, x))
    assert {"moe_grouped_gemm_sm80_fwd", "moe_swiglu_fwd"} <= targets, targets
    assert "moe_grouped_gemm_swiglu_fwd" not in targets, targets


def test_unfused_gate_up_on_sm80_equals_reference_with_grads(monkeypatch):
    """gate_up_swiglu where only the fused kernel is missing (a faked A100): the unfused path's
    output and gradients (here the references of its ops) equal the fused op's reference."""
    _fake_device(monkeypatch, 86)
    seed = _seed()
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    lhs = jax.random.normal(k1, (24, 16), jnp.float32)
    w = jax.random.normal(k2, (3, 16, 32), jnp.float32) / 4
    rw = jax.random.uniform(k3, (24, ))
    dact = jax.random.normal(k4, (24, 16), jnp.float32)
    gs = jnp.array([10, 0, 9])

    def run(fn):
        out, vjp = jax.vjp(fn, lhs, w, rw)
        return out, *vjp(dact)

    with jax.default_matmul_precision("highest"):
        with pytest.warns(UserWarning, match="runs unfused"):
            got = run(lambda a, b, r: ops.gate_up_swiglu(
                a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), gs, r, backend="cuda").astype(
                    jnp.float32))
        want = run(lambda a, b, r: gate_up.gate_up_swiglu_reference(a.astype(
            jnp.bfloat16), b.astype(jnp.bfloat16), gs, r)[2].astype(jnp.float32))
    for g, r_, name in zip(got, want, ("act", "dlhs", "dw", "drow")):
        assert rel_err(g, r_) < RTOL_16, f"{name} seed={seed}"
    with pytest.raises(ValueError, match="configures the fused kernel, which does not run here"):
        ops.gate_up_swiglu(lhs.astype(jnp.bfloat16),
                           w.astype(jnp.bfloat16),
                           gs,
                           backend="cuda",
                           config="coop_128x256_c2x1")


def test_xla_on_a_gpu_warns_once_naming_the_cost(monkeypatch):
    """kernel_backend='xla' (or 'auto' with no usable kernel, or a problem no kernel takes) on a
    GPU warns once per reason that ragged_dot there computes E times the useful work; on the
    CPU it does not warn."""
    monkeypatch.delenv(backend.ENV_GROUPED_GEMM, raising=False)
    lhs, rhs, gs, _ = _inputs(16, 8, 8, 2, "balanced", jnp.float32, _seed())
    backend.reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.grouped_gemm(lhs, rhs, gs, backend="xla")  # the CPU: no warning
    monkeypatch.setattr(backend, "jax_platform", lambda: "gpu")
    with pytest.warns(UserWarning, match=r"kernel_backend='xla'.*E times the useful work"):
        ops.grouped_gemm(lhs, rhs, gs, backend="xla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.grouped_gemm(lhs, rhs, gs, backend="xla")  # once
    if not backend.cuda_status("grouped_gemm")[0]:
        with pytest.warns(UserWarning, match=r"no usable kernel.*E times the useful work"):
            ops.grouped_gemm(lhs, rhs, gs, backend="auto")
    _fake_device(monkeypatch, 80)  # a kernel, but float32 inputs: the reference, and the cost
    with pytest.warns(UserWarning, match=r"takes bf16 lhs and rhs.*E times the useful work"):
        ops.grouped_gemm(lhs, rhs, gs, backend="cuda")
