"""The sm_80 grouped GEMM (CUTLASS 2.x GemmGrouped) and the choice of kernel by device capability.

CPU: the kernel family and every op's backend with a faked device (compute capability, library
loaded, JAX on a GPU), MOE_PRAXIS_GROUPED_GEMM, the rule and configuration names, the warning
that ragged_dot on a GPU computes E times the useful work, and, lowered for CUDA on the CPU
(jax.export), which FFI targets a faked A100 would run.
GPU (the `gpu` marker): the sm_80 kernels forced on the GPU at hand (MOE_PRAXIS_GROUPED_GEMM=
sm80; sm_80 code runs on a Hopper GPU) with the cases of tests/test_grouped_gemm.py, against
a float64 loop on the same bf16 / fp16 values (1e-2 norm-wise: fp32 accumulation, then one
rounding of the output to bf16, <= 2^-9 relative; fp16's is finer), and the whole moe_block.
Inputs are fresh random draws every run (the seed is printed on failure).
"""

import dataclasses
import importlib
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops import backend
from tests.test_grouped_gemm import GPU_SHAPES, KINDS, _inputs, loop_grads, loop_reference
from tests.testutil import rel_err
from tests.testutil import seed as _seed

gg = importlib.import_module("moe_praxis.ops.grouped_gemm")
gate_up = importlib.import_module("moe_praxis.ops.gate_up")

REPO = Path(__file__).resolve().parent.parent
RTOL_16 = 1e-2
SHAPES = {  # the grouped GEMM benchmark's A, B, C: (E, M, K, N)
    "A": (8, 32768, 4096, 14336),
    "B": (32, 32768, 7168, 2048),
    "C": (128, 65536, 2048, 768),
}

# ------------------------------------------------------------------ faked devices (CPU)


def _fake_device(monkeypatch, cc, name="NVIDIA A100-SXM4-80GB", smem=163 * 1024):
    """This process as a host whose driver sees one GPU of compute capability `cc`, JAX running
    on it and the kernel library loaded (device_query, jax_cuda_reason, library_status)."""
    dev = {
        "reason":
        "",
        "driver_version":
        13000,
        "runtime_version":
        13000,
        "devices": [{
            "name": name,
            "compute_capability": cc,
            "sm_count": 108,
            "shared_memory_per_block": smem,
        }]
    }
    monkeypatch.setattr(backend, "device_query", lambda: dev)
    monkeypatch.setattr(backend, "jax_cuda_reason", lambda: "")
    monkeypatch.setattr(backend, "library_status", lambda: (True, "loaded from a faked path"))
    monkeypatch.delenv(backend.ENV_GROUPED_GEMM, raising=False)
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    backend.reset_warnings()


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
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in backend.KERNELS]
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    return re.findall(r"custom_call @(moe_\w+)", exp.mlir_module())


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
            "moe_permute"} <= targets, targets
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


# ------------------------------------------------------------------ the rule and the names


def test_rule_examples_of_the_docs(monkeypatch):
    """The wave-count rule (no measured shape within reach: SM80_MEASURED emptied here) and the
    examples the docs give of it."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    monkeypatch.setattr(importlib.import_module("moe_praxis.ops.grouped_gemm_sm80"),
                        "SM80_MEASURED", {})
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            assert gg.choose_sm80_config(op, m, k, n, e) == "sm80_128x256x64_s3", (op, m, k, n, e)
    assert gg.choose_sm80_config("fwd", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert gg.choose_sm80_config("dgrad", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert gg.choose_sm80_config("wgrad", 16384, 2048, 768, 128) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", 8192, 64, 64, 8) == "sm80_128x64x32_s4"
    assert gg.choose_sm80_config("fwd", 8192, 1024, 512, 8) == "sm80_128x128x32_s4"
    doc = (REPO / "docs" / "grouped_gemm_sm80.md").read_text()
    for name in gg.SM80_TILE_CONFIGS:
        assert f"`{name}`" in doc, f"docs/grouped_gemm_sm80.md does not describe {name}"
    flat = " ".join(doc.split())
    assert "`choose_sm80_config('fwd', 8192, 64, 64, 8)` -> `sm80_128x64x32_s4`" in flat
    assert "`choose_sm80_config('fwd', 16384, 2048, 768, 128)` -> `sm80_64x128x32_s4`" in flat
    with pytest.raises(ValueError, match="op='up' is invalid"):
        gg.choose_sm80_config("up", 8, 8, 8, 1)
    # the 128x256 tile needs 144 KiB of shared memory: on sm_86 / sm_89 (99 KiB) the rule
    # takes 128x128; the shared memory of each tile is its mainloop's stages of A and B
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            assert gg.choose_sm80_config(op, m, k, n, e, 99 * 1024) == "sm80_128x128x32_s4"
            assert gg.choose_sm80_config(op, m, k, n, e, 227 * 1024) == "sm80_128x256x64_s3"
    assert [gg.sm80_shared_memory(c) // 1024
            for c in gg.SM80_TILE_CONFIGS] == [144, 64, 48, 48, 144, 96, 96, 96, 80, 80]
    assert "on an sm_86 GPU (99 KiB per block) A, B and C take `sm80_128x128x32_s4`" in flat


def test_rule_takes_the_nearest_measured_shape_and_its_fastest_tile_that_fits(monkeypatch):
    """SM80_MEASURED (the sweep's per-shape rankings) decides near a measured shape: the nearest
    one's fastest tile whose shared memory fits the GPU; beyond MEASURED_REACH in any per-group
    dimension, and for groups of at most 128 rows, the wave-count rule decides as before."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    sm80 = importlib.import_module("moe_praxis.ops.grouped_gemm_sm80")
    e, m, k, n = SHAPES["B"]
    ranking_b = ("sm80_256x128x64_s3", "sm80_128x256x32_s4", "sm80_128x128x32_s4")
    ranking_c = ("sm80_128x128x64_s3", "sm80_64x256x32_s4")
    monkeypatch.setattr(sm80, "SM80_MEASURED",
                        {"fwd": ((SHAPES["B"], ranking_b), (SHAPES["C"], ranking_c))})
    assert gg.choose_sm80_config("fwd", m, k, n, e) == "sm80_256x128x64_s3"
    # 144 KiB does not fit 99 KiB: the next measured tile
    assert gg.choose_sm80_config("fwd", m, k, n, e, 99 * 1024) == "sm80_128x256x32_s4"
    # per group 2x the rows and half the width of B: still nearest B
    assert gg.choose_sm80_config("fwd", 2 * m, k, n // 2, e) == "sm80_256x128x64_s3"
    # C's neighbourhood (per group 512 rows, N = 768, K = 2048)
    assert gg.choose_sm80_config("fwd", 65536, 2048, 1024, 128) == "sm80_128x128x64_s3"
    # dgrad has no measured shapes; K 8x beyond reach: the wave-count rule
    assert gg.choose_sm80_config("dgrad", m, k, n, e) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", m, 8 * k, n, e) == "sm80_128x256x64_s3"
    assert gg.choose_sm80_config("fwd", 16384, 2048, 768, 128) == "sm80_64x128x32_s4"
    assert sm80.measured_ranking("fwd", m, k, n, e) == ranking_b
    assert sm80.measured_ranking("wgrad", m, k, n, e) is None
    assert sm80.sm80_problem("wgrad", 1024, 64, 32, 8) == (64, 32, 128)


def test_measured_rankings_are_whole_and_the_rule_takes_them_at_the_benchmark_shapes(monkeypatch):
    """SM80_MEASURED (the sweep's rankings, pasted from the benchmark): per op the three
    benchmark shapes, each ranking every tile once; at A, B and C the rule takes the measured
    winners (128x256x32 for fwd and wgrad, 256x128x32 for dgrad, both 96 KiB: the same on a
    99 KiB GPU), as docs/grouped_gemm_sm80.md says."""
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    sm80 = importlib.import_module("moe_praxis.ops.grouped_gemm_sm80")
    assert set(sm80.SM80_MEASURED) == set(gg.OPS)
    for op, entries in sm80.SM80_MEASURED.items():
        assert sorted(shape for shape, _ in entries) == sorted(SHAPES.values()), op
        for shape, ranking in entries:
            assert sorted(ranking) == sorted(gg.SM80_TILE_CONFIGS), (op, shape)
    want = {
        "fwd": "sm80_128x256x32_s4",
        "dgrad": "sm80_256x128x32_s4",
        "wgrad": "sm80_128x256x32_s4"
    }
    for e, m, k, n in SHAPES.values():
        for op in gg.OPS:
            for smem in (None, 99 * 1024, 227 * 1024):
                assert gg.choose_sm80_config(op, m, k, n, e, smem) == want[op], (op, e, smem)
    flat = " ".join((REPO / "docs" / "grouped_gemm_sm80.md").read_text().split())
    assert ("`choose_sm80_config` gives `sm80_128x256x32_s4` for fwd and wgrad and "
            "`sm80_256x128x32_s4` for dgrad at A, B and C (measured)") in flat


def test_tiles_match_the_kernel_header():
    """SM80_TILE_CONFIGS (index = the `tile` attribute) names the header's tiles in the order of
    its dispatch: threadblock shape and stages of each Tile<...> alias."""
    header = (REPO / "kernels" / "grouped_gemm_sm80.cuh").read_text()
    aliases = {
        alias: tuple(int(v) for v in dims)
        for alias, *dims in re.findall(
            r"using (Tile\w+) = Tile<(\d+), (\d+), (\d+), \d+, \d+, \d+, (\d+)>", header)
    }
    assert len(aliases) == len(gg.SM80_TILE_CONFIGS), aliases
    cases = re.findall(
        r"case (\d+):\s*return run_grouped<GemmDef<Element, LayoutA, LayoutB, "
        r"(Tile\w+)>", header)
    assert [int(i) for i, _ in cases] == list(range(len(gg.SM80_TILE_CONFIGS)))
    for (i, alias), name in zip(cases, gg.SM80_TILE_CONFIGS):
        assert aliases[alias] == gg.sm80_tile_shape(name), (i, alias, name)
    assert f"kNumTiles = {len(gg.SM80_TILE_CONFIGS)}" in header


def test_configs_of_the_other_family_are_errors(monkeypatch):
    """A forced configuration must belong to the family that runs: an sm_80 name on a Hopper
    GPU, a Hopper name on an A100, or a bad sm_80 name, is an error naming the valid ones."""
    lhs, rhs, gs, _ = _inputs(32, 16, 16, 2, "balanced", jnp.bfloat16, _seed())
    with pytest.raises(ValueError, match=r"config 'sm80_1x1x1_s1' is invalid; valid: \('sm80_"):
        ops.grouped_gemm(lhs, rhs, gs, config="sm80_1x1x1_s1")
    _fake_device(monkeypatch, 80)
    with pytest.raises(ValueError, match=r"not a configuration of the sm80 kernels.*'sm80_128x256"):
        ops.grouped_gemm(lhs, rhs, gs, backend="cuda", config="coop_128x256_c2x1")
    _fake_device(monkeypatch, 90)
    with pytest.raises(ValueError, match=r"not a configuration of the sm90 kernels"):
        ops.grouped_gemm(lhs, rhs, gs, backend="cuda", config="sm80_128x128x32_s4")
    _fake_device(monkeypatch, 80)
    monkeypatch.setenv(gg.ENV_TILE, "pingpong_128x192_c1x1")
    with pytest.raises(ValueError, match="MOE_PRAXIS_GG_TILE.*invalid while the sm_80"):
        gg.choose_sm80_config("fwd", 64, 16, 16, 2)
    monkeypatch.setenv(gg.ENV_TILE, "sm80_128x64x32_s4")
    assert gg.choose_sm80_config("wgrad", 1 << 20, 4096, 4096, 8) == "sm80_128x64x32_s4"


def test_both_families_take_their_ffi_checks_from_the_shared_header():
    """kernels/grouped_gemm_common.h holds the error strings of the grouped GEMM handlers' FFI
    checks (tile, workspace, shapes, alignment, CUDA / CUTLASS failures) and the workspace
    layout; the Hopper and sm_80 headers and handlers use it and keep no copy of their own."""
    kernels = REPO / "kernels"
    common = (kernels / "grouped_gemm_common.h").read_text()
    for helper in ("invalid_tile", "workspace_too_small", "shape_error", "check_multiples_of_8",
                   "cuda_error", "cutlass_error", "zero_range", "Carver"):
        assert re.search(rf"\b{helper}\b", common), helper
    # The Hopper and sm_80 families; the FP8 kernels (grouped_gemm_fp8*) do not use the shared
    # checks yet and keep their own messages.
    sources = {
        p.name: p.read_text()
        for p in kernels.glob("grouped_gemm*")
        if p.name != "grouped_gemm_common.h" and not p.name.startswith("grouped_gemm_fp8")
    }
    assert set(sources) >= {
        "grouped_gemm.cuh", "grouped_gemm_sm80.cuh", "grouped_gemm_fwd.cu",
        "grouped_gemm_sm80_fwd.cu"
    }, sorted(sources)
    for name, text in sources.items():
        for copy in ("is invalid; valid: 0..", "bytes is too small", ": need ", "take(size_t",
                     "make_uint4(0, 0, 0, 0)", "must be multiples of 8"):
            assert copy not in text, f"kernels/{name} keeps its own {copy!r}"
    for name in ("grouped_gemm.cuh", "grouped_gemm_sm80.cuh"):
        assert '#include "grouped_gemm_common.h"' in sources[name], name
        assert "moe_gg_common::invalid_tile(kWho" in sources[name], name
        assert "moe_gg_common::workspace_too_small(kWho" in sources[name], name
    for name, text in sources.items():
        if name.endswith(".cu") and "swiglu" not in name:
            assert "moe_gg_common::shape_error(kWho" in text, name


def test_workspace_bytes():
    for e in (1, 2, 3, 64, 257):
        assert gg.sm80_workspace_bytes(e) % 256 == 0
        assert gg.sm80_workspace_bytes(e) >= 12 * e + 6 * 8 * e  # the header's seven arrays


# ------------------------------------------------------------------------------ GPU


@pytest.fixture
def sm80(monkeypatch):
    """The sm_80 kernels forced on this GPU (skips without a usable grouped GEMM)."""
    monkeypatch.setenv(backend.ENV_GROUPED_GEMM, "sm80")
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    ok, why = backend.cuda_status("grouped_gemm")
    if not ok:
        pytest.skip(f"CUDA grouped GEMM not usable: {why}")
    assert backend.grouped_gemm_kernel()[0] == "sm80"


@pytest.mark.gpu
@pytest.mark.usefixtures("sm80")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tile", gg.SM80_TILE_CONFIGS)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_sm80_kernels_every_tile_and_case(shape, tile, dtype):
    """fwd, dgrad and wgrad of every tile, bf16 and fp16, on every group-size pattern (empty
    groups, 1-row groups, sum < M, one expert takes all, ...; M not a multiple of any tile),
    outputs poisoned by a call with other inputs before; rows past the sum and empty experts'
    wgrad exactly zero."""
    m, k, n, e = shape
    run = {
        op: jax.jit(lambda a, b, g, op=op, out=out: gg.run_sm80_kernel(op, out, a, b, g, tile))
        for op, out in (("fwd", (m, n)), ("dgrad", (m, k)), ("wgrad", (e, k, n)))
    }
    for kind in KINDS:
        seed = _seed()
        lhs, rhs, gs, dout = _inputs(m, k, n, e, kind, dtype, seed)
        msg = f"seed={seed} {kind} {tile} {dtype.__name__} sizes={np.asarray(gs)}"
        total = int(np.asarray(gs).sum())
        jax.block_until_ready(run["fwd"](lhs + 1, rhs * 3, gs))  # poison
        out = run["fwd"](lhs, rhs, gs)
        assert out.dtype == dtype
        assert rel_err(out, loop_reference(lhs, rhs, gs)) < RTOL_16, msg
        np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0, err_msg=msg)
        ref_dl, ref_dr = loop_grads(lhs, rhs, gs, dout)
        jax.block_until_ready(run["dgrad"](dout * 2, rhs + 1, gs))
        dl = run["dgrad"](dout, rhs, gs)
        assert rel_err(dl, ref_dl) < RTOL_16, msg
        np.testing.assert_array_equal(np.asarray(dl[total:], np.float32), 0.0, err_msg=msg)
        jax.block_until_ready(run["wgrad"](lhs + 2, dout * 3, gs))
        dr = run["wgrad"](lhs, dout, gs)
        assert rel_err(dr, ref_dr) < RTOL_16, msg
        empty = np.asarray(gs) == 0
        np.testing.assert_array_equal(np.asarray(dr, np.float32)[empty], 0.0, err_msg=msg)


@pytest.mark.gpu
@pytest.mark.usefixtures("sm80")
def test_bad_calls_fail_with_the_shared_messages_naming_the_family():
    """The handlers' FFI checks (kernels/grouped_gemm_common.h) as each family reports them: a
    tile out of range, a workspace too small, K or N not a multiple of 8, operands of the wrong
    shape; the Hopper family's where the GPU runs it (compute capability 9.0)."""
    ffi = backend.ffi  # the library layer's FFI call, through its public face
    m, k, n, e = 64, 16, 24, 2
    lhs, rhs, gs, _ = _inputs(m, k, n, e, "balanced", jnp.bfloat16, _seed())
    ws = jax.ShapeDtypeStruct((gg.sm80_workspace_bytes(e), ), jnp.uint8)

    def call(target, a, b, out_shape, workspace=ws, **attrs):
        res = ffi(target, (jax.ShapeDtypeStruct(out_shape, a.dtype), workspace), a, b, gs, **attrs)
        jax.block_until_ready(res)

    who = "moe_praxis grouped GEMM (sm_80)"
    bad = len(gg.SM80_TILE_CONFIGS)
    cases = [
        (dict(tile=bad), f"{who}: tile={bad} is invalid; valid: 0..{bad - 1}"),
        (dict(tile=1, workspace=jax.ShapeDtypeStruct((16, ), jnp.uint8)),
         f"{who}: workspace of 16 bytes is too small; it needs 256 (sm80_workspace_bytes"),
        (dict(tile=1, out_shape=(m, n + 8)),
         f"{who} fwd: need lhs [M,K], rhs [E,K,N], group_sizes [E], out [M,N]"),
    ]
    for kw, msg in cases:
        kw = dict(kw)
        out_shape = kw.pop("out_shape", (m, n))
        with pytest.raises(Exception, match=re.escape(msg)):
            call(gg.SM80_TARGETS["fwd"], lhs, rhs, out_shape, **kw)
    odd = rhs[:, :, :20]  # N = 20
    with pytest.raises(
            Exception,
            match=re.escape(f"{who} fwd: K and N must be multiples of 8, got 20 and 16")):
        call(gg.SM80_TARGETS["fwd"], lhs, odd, (m, 20), tile=1)
    if backend.compute_capability() != 90:
        return
    hopper = dict(raster=0, swizzle=1, split_rows=0)
    bad = len(gg.TILE_CONFIGS)
    with pytest.raises(Exception,
                       match=re.escape(f"moe_praxis grouped GEMM: tile={bad} is invalid; "
                                       f"valid: 0..{bad - 1}")):
        call(gg.TARGETS["fwd"], lhs, rhs, (m, n), tile=bad, **hopper)
    with pytest.raises(Exception,
                       match=re.escape("moe_praxis grouped GEMM: workspace of 16 bytes is too "
                                       "small; it needs 256 (workspace_bytes")):
        call(gg.TARGETS["fwd"],
             lhs,
             rhs, (m, n),
             workspace=jax.ShapeDtypeStruct((16, ), jnp.uint8),
             tile=0,
             **hopper)


@pytest.mark.gpu
@pytest.mark.usefixtures("sm80")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sm80_op_grads_match_jax_grad_of_reference_and_sizes_change_without_recompiling(dtype):
    """ops.grouped_gemm (backend 'cuda', sm_80 forced) under one jit: the FFI targets are the
    sm_80 ones, gradients match jax.grad of ragged_dot (float32 products of the same values)
    for every pattern, and new group sizes reuse the executable."""
    m, k, n, e = 1000, 136, 200, 8

    def loss(fn, a, b, g, d):
        return jnp.sum(fn(a, b, g).astype(jnp.float32) * d.astype(jnp.float32))

    ours = jax.jit(
        jax.value_and_grad(lambda a, b, g, d: loss(
            lambda x, w, gg_: ops.grouped_gemm(x, w, gg_, backend="cuda"), a, b, g, d),
                           argnums=(0, 1)))
    ref = jax.jit(
        jax.value_and_grad(lambda a, b, g, d: loss(
            lambda x, w, gg_: jax.lax.ragged_dot(x.astype(jnp.float32),
                                                 w.astype(jnp.float32),
                                                 gg_,
                                                 precision=jax.lax.Precision.HIGHEST), a, b, g, d),
                           argnums=(0, 1)))
    lhs, rhs, gs, dout = _inputs(m, k, n, e, "balanced", dtype, _seed())
    hlo = ours.lower(lhs, rhs, gs, dout).as_text()
    assert "moe_grouped_gemm_sm80_fwd" in hlo and "moe_grouped_gemm_sm80_wgrad" in hlo
    assert "moe_grouped_gemm_fwd" not in hlo
    for kind in KINDS:
        seed = _seed()
        lhs, rhs, gs, dout = _inputs(m, k, n, e, kind, dtype, seed)
        (_, (dl, dr)), (_, (rl, rr)) = ours(lhs, rhs, gs, dout), ref(lhs, rhs, gs, dout)
        msg = f"seed={seed} {kind}"
        assert rel_err(dl, rl) < RTOL_16 and rel_err(dr, rr) < RTOL_16, msg
    assert ours._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.usefixtures("sm80")
@pytest.mark.parametrize("fuse", [False, True])
def test_moe_block_with_forced_sm80_kernels_matches_reference(fuse):
    """The whole moe_block (kernel_backend='cuda', sm_80 grouped GEMM forced; with fuse_gate_up
    the unfused path) against the XLA reference: loss and every gradient, 2e-2 norm-wise (bf16
    activations between the stages)."""
    cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=128, d_ff=256, fuse_gate_up=fuse)
    seed = _seed()
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (4, 96, cfg.d_model), jnp.float32).astype(jnp.bfloat16)

    def run(backend_name):
        c = dataclasses.replace(cfg, kernel_backend=backend_name)

        def loss(p, xx):
            o = mp.moe_block(p, xx, c)
            terms = o.y.astype(jnp.float32) * jnp.sin(xx.astype(jnp.float32))
            return jnp.sum(terms) + o.aux_loss, (o.y, jnp.sum(jnp.abs(terms)))

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        return f.lower(params, x).as_text(), f(params, x)

    hlo, ((lc, (yc, _)), gc) = run("cuda")
    assert "moe_grouped_gemm_sm80_fwd" in hlo and "moe_grouped_gemm_swiglu_fwd" not in hlo
    _, ((lx, (yx, scale)), gx) = run("xla")
    assert rel_err(yc, yx) < 2e-2, f"seed={seed}"
    # The loss is a sum whose terms cancel (|loss| can be a few % of sum |terms|): bounded
    # against the terms' magnitude. With fuse_gate_up the XLA reference keeps gate and up in
    # float32 where the unfused CUDA path rounds them to bf16 (a measured 0.5% on y).
    assert abs(float(lc) - float(lx)) <= 2e-2 * float(scale), f"seed={seed}"
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gx)):
        assert rel_err(a, b) < 2e-2, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.usefixtures("sm80")
def test_sm80_kernels_inside_cuda_graphs():
    """The sm_80 handlers declare XLA's command-buffer trait: the grouped GEMM and the whole
    moe_block run captured into CUDA graphs (tests/test_grouped_gemm.py's script, with the sm_80
    kernels forced in the child process)."""
    import json
    import os
    import subprocess
    import sys

    from tests import test_grouped_gemm as t

    script = t._COMMAND_BUFFER_SCRIPT.replace('"moe_grouped_gemm_fwd"',
                                              '"moe_grouped_gemm_sm80_fwd"')
    assert script != t._COMMAND_BUFFER_SCRIPT
    seed = _seed()
    env = dict(os.environ)
    env[backend.ENV_GROUPED_GEMM] = "sm80"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")
    proc = subprocess.run([sys.executable, "-c", script,
                           str(REPO), str(seed)],
                          capture_output=True,
                          text=True,
                          env=env,
                          cwd=REPO,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"seed={seed}\n{proc.stdout[-3000:]}\n"
                                            f"{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["gg_hlo_has_kernel"] and res["gg_stats"]["captured"] > 0, res
    assert res["gg_cache_size"] == 1, res
    for kind, errs in zip(KINDS, res["gg_errs"]):
        assert max(errs) < RTOL_16, f"seed={seed} {kind}: {errs}"
    lc, lx = res["block_loss"]
    assert abs(lc - lx) <= 2e-2 * abs(lx), f"seed={seed} {res}"
    assert max(res["block_grad_errs"]) < 2e-2, f"seed={seed} {res}"


def test_benchmark_sm80_summary_ratios():
    """The benchmark's sm_80 summary: speed ratios against dense, ragged_dot and the Hopper
    kernel (> 1: the sm_80 kernel is faster) and the fastest sm_80 tile timed."""
    from benchmarks.bench_grouped_gemm import sm80_summary

    rows = [
        dict(shape="A", dist="skewed", op="fwd", method=meth, ms=ms, tflops=tf, config=cfg)
        for meth, ms, tf, cfg in (("dense", 1.0, 700, "-"), ("ragged", 6.0, 100, "-"),
                                  ("ours", 0.8, 800, "-"), ("sm80", 2.0, 350, "sm80_128x256x64_s3"),
                                  ("sm80[sm80_128x128x32_s4]", 1.6, 420, "sm80_128x128x32_s4"))
    ]
    line = sm80_summary(rows).splitlines()[-1]
    assert "| 0.50 | 3.00 | 0.40 | sm80_128x128x32_s4 (420) |" in line, line
    assert sm80_summary(rows[:3]).count("\n") == 1  # no sm80 rows: the header only


def test_kernels_for_sm80_are_compiled_for_sm80():
    """The router, SwiGLU, permute and aux-loss kernels and the sm_80 grouped GEMM are built
    as sm_80 machine code plus compute_80 PTX (newer GPUs JIT it), and their requirement says
    8.0; the Hopper grouped GEMM and the fused gate/up are sm_90a only, on 9.0."""
    from moe_praxis import build_kernels

    sm80 = {build_kernels.GENCODES["sm_80"], build_kernels.GENCODES["compute_80"]}
    for name in ("router.cu", "swiglu.cu", "permute.cu", "aux_loss.cu", "grouped_gemm_sm80_fwd.cu",
                 "grouped_gemm_sm80_dgrad.cu", "grouped_gemm_sm80_wgrad.cu"):
        assert sm80 <= set(build_kernels.gencodes_for(REPO / "kernels" / name)), name
    for name in ("grouped_gemm_fwd.cu", "grouped_gemm_swiglu.cu"):
        assert build_kernels.gencodes_for(REPO / "kernels" /
                                          name) == [build_kernels.GENCODES["sm_90a"]], name
    for op in ("router", "swiglu", "permute", "aux_loss", "grouped_gemm"):
        assert backend.COMPUTE_CAPABILITY[op] == (80, None), op
    assert backend.COMPUTE_CAPABILITY["gate_up_swiglu"] == backend.GROUPED_GEMM_KERNELS["sm90"]
    assert backend.GROUPED_GEMM_KERNELS == {"sm90": (90, 91), "sm80": (80, None)}


def test_benchmark_sm80_sweep_table_and_rankings_for_the_rule():
    """The sweep (--sm80 --sm80-tiles): which tiles a value selects, the table of every tile's
    TFLOP/s with the fastest marked, and the balanced points' rankings in SM80_MEASURED's form
    (pasted, the rule takes them)."""
    from benchmarks import sm80_sweep
    from benchmarks.bench_grouped_gemm import SHAPES as BENCH_SHAPES
    from benchmarks.bench_grouped_gemm import parse_sm80_tiles

    assert parse_sm80_tiles("all") == list(gg.SM80_TILE_CONFIGS)
    assert parse_sm80_tiles("rule") == "rule"
    assert parse_sm80_tiles("sm80_64x256x32_s4,sm80_128x128x64_s3") == [
        "sm80_64x256x32_s4", "sm80_128x128x64_s3"
    ]
    with pytest.raises(ValueError, match=r"'sm80_9x9x9_s9' is invalid; valid: \('sm80_"):
        parse_sm80_tiles("sm80_9x9x9_s9")
    a, b, c = gg.SM80_TILE_CONFIGS[:3]

    def row(shape, dist, op, method, ms, cfg="-"):
        return dict(shape=shape,
                    dist=dist,
                    op=op,
                    method=method,
                    ms=ms,
                    tflops=100 / ms,
                    config=cfg)

    rows = [
        row("A", "balanced", "fwd", "dense", 1.0),
        row("A", "balanced", "fwd", "ragged", 8.0),
        row("A", "balanced", "fwd", "sm80", 2.0, a),
        row("A", "balanced", "fwd", f"sm80[{b}]", 1.6, b),
        row("A", "balanced", "fwd", f"sm80[{c}]", 4.0, c),
        row("A", "skewed", "fwd", "sm80", 2.0, a),
        row("A", "skewed", "fwd", f"sm80[{c}]", 1.0, c),
        row("C", "balanced", "wgrad", "dense", 1.0),
        row("C", "balanced", "wgrad", "sm80", 3.0, c),
    ]
    table = sm80_sweep.sweep_table(rows, [a, b, c]).splitlines()
    assert len(table) == 2 + 3, table
    assert "| A | balanced | fwd | 100 | 50 | **62** | 25 | " in table[2], table[2]
    assert table[2].endswith(f"| {a} | {b} | 0.62 | 5.00 |"), table[2]
    assert "| **100** |" in table[3] and table[3].endswith("| - | - |"), table[3]
    won = sm80_sweep.winners(rows, BENCH_SHAPES)
    assert won == {"fwd": [(BENCH_SHAPES["A"], (b, a, c))], "wgrad": [(BENCH_SHAPES["C"], (c, ))]}
    text = sm80_sweep.winners_literal(won)
    assert text.startswith("SM80_MEASURED = {")
    assert eval(text[len("SM80_MEASURED = "):]) == {op: tuple(v) for op, v in won.items()}
