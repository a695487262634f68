"""Backend selection for the primitives: 'auto' | 'xla' | 'cuda'.

'auto' uses a CUDA kernel only where a CUDA driver sees a GPU, the kernel library loaded and
the GPU meets the op's compute-capability requirement (`COMPUTE_CAPABILITY`, the one statement
of what each kernel needs); otherwise the pure-JAX ('xla') reference. Asking for 'cuda' where it
is not usable raises an error that says why.

The block resolves its backend ONCE (`resolve_backend`) and passes 'xla' or 'cuda' to every op;
an op given a resolved backend does not resolve again (`op_backend`): with 'cuda' it only checks
its own requirement and falls back, warning once (`warn_fallback`, the one warn-once of the
package), where the GPU or the problem does not fit its kernel. An op called directly with
'auto' resolves for itself.

The grouped GEMM has two kernel families, chosen here only (`grouped_gemm_kernel`): the Hopper
kernels (sm_90a) on compute capability 9.0, the CUTLASS 2.x sm_80 kernels on every other GPU
from 8.0 and for fp16; $MOE_PRAXIS_GROUPED_GEMM forces one. The fused gate/up kernel stands on
the Hopper ones; beside the sm_80 ones gate_up runs unfused. `backend_info()['cuda']['ops']`
says which kernel each op runs and why. Where the grouped GEMM runs ragged_dot on a GPU,
`warn_xla_on_gpu` names the cost (E times the useful work).

The device (compute capability, SM count, driver and runtime versions) is queried through
cuda-python (`cuda.bindings.driver`) without initialising a JAX backend; without a CUDA driver
or cuda-python the query degrades to a reason ("no GPU: ..."). Tests and tools read the library
layer's public names here: `KERNELS`, the environment variable, `library_state()`, `call_stats()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings

import jax

from moe_praxis.ops import _library
from moe_praxis.ops.fp8 import rule as fp8_rule
from moe_praxis.ops._library import (  # noqa: F401  (the library layer's public names)
    DEFAULT_LIB, ENV_LIB, KERNELS, LIB_NAME, call_stats, ffi, library_path, library_status,
    load_library)

try:
    from cuda.bindings import driver as _driver
    from cuda.bindings import runtime as _runtime
    from cuda.pathfinder import DynamicLibNotFoundError
    _CUDA_PYTHON_ERROR = ""
except ImportError as e:  # a dependency, but an install without it still imports
    _driver = _runtime = None
    DynamicLibNotFoundError = OSError
    _CUDA_PYTHON_ERROR = f"cuda-python is not installed ({e}); pip install 'cuda-python>=12.6'"

BACKENDS = ("auto", "xla", "cuda")

# Compute capability (major * 10 + minor) each op family's kernels run on: [minimum, first one
# they cannot run) (None: no upper bound). The fused gate/up GEMM is sm_90a code (wgmma, TMA):
# architecture-specific, it runs on compute capability 9.0 only. The other kernels (the grouped
# GEMM's sm_80 kernels among them) are sm_80 machine code plus compute_80 PTX that newer GPUs
# compile at load time. Which grouped GEMM kernel runs where: GROUPED_GEMM_KERNELS and
# grouped_gemm_kernel().
COMPUTE_CAPABILITY: dict[str, tuple[int, int | None]] = {
    "aux_loss": (80, None),
    "router": (80, None),
    "swiglu": (80, None),
    "permute": (80, None),
    "grouped_gemm": (80, None),
    "gate_up_swiglu": (90, 91),
    "fp8_quant": (80, None),
    # the FP8 grouped GEMMs (ops.fp8.gemm): sm_90a code (FP8 wgmma, TMA), compute capability 9.0
    "fp8_grouped_gemm": (90, 91),
}
DEFAULT_COMPUTE_CAPABILITY: tuple[int, int | None] = (80, None)
# The grouped GEMM's two kernel families and the compute capabilities each runs on: 'sm90'
# (kernels/grouped_gemm_{fwd,dgrad,wgrad}.cu: CUTLASS 3 ptr-array, wgmma + TMA, sm_90a code, bf16)
# and 'sm80' (kernels/grouped_gemm_sm80_*.cu: CUTLASS 2.x GemmGrouped, mma.sync, bf16 and fp16).
GROUPED_GEMM_KERNELS: dict[str, tuple[int, int | None]] = {"sm90": (90, 91), "sm80": (80, None)}
# Environment variable choosing the grouped GEMM kernel family: 'auto' (default: 'sm90' on
# compute capability 9.0, else 'sm80'), 'sm80' (force the sm_80 kernels, e.g. to test and time
# them on a Hopper GPU) or 'sm90'. Read by grouped_gemm_kernel() only.
ENV_GROUPED_GEMM = "MOE_PRAXIS_GROUPED_GEMM"
GROUPED_GEMM_CHOICES = ("auto", "sm90", "sm80")
# force_grouped_gemm's choice while one is in force (ahead of the environment variable).
_FORCED_GROUPED_GEMM = contextvars.ContextVar("moe_praxis_grouped_gemm", default=None)


def _call(fn, *args):  # a cuda.bindings call: its values, or RuntimeError naming the CUresult
    err, *values = fn(*args)
    if int(err) != 0:
        raise RuntimeError(f"{fn.__name__} failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def device_query() -> dict:
    """The CUDA devices as the driver sees them (cached; no JAX backend is initialised).

    {'reason': '' or why there is no usable GPU, 'driver_version': int or None,
    'runtime_version': int or None, 'devices': [{'name', 'compute_capability' (major*10+minor),
    'sm_count', 'shared_memory_per_block' (bytes a block may opt in to)}]}.
    """
    out = {"reason": "", "driver_version": None, "runtime_version": None, "devices": []}
    if _driver is None:
        out["reason"] = f"no GPU query: {_CUDA_PYTHON_ERROR}"
        return out
    try:
        out["runtime_version"] = int(_call(_runtime.cudaRuntimeGetVersion))
    except Exception:  # noqa: BLE001 - the runtime version is informative only
        pass
    attr = _driver.CUdevice_attribute
    try:
        _call(_driver.cuInit, 0)
        out["driver_version"] = int(_call(_driver.cuDriverGetVersion))
        for i in range(int(_call(_driver.cuDeviceGetCount))):
            dev = _call(_driver.cuDeviceGet, i)
            major, minor, sms, smem = (int(
                _call(_driver.cuDeviceGetAttribute, a,
                      dev)) for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                      attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                      attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                      attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
            name = _call(_driver.cuDeviceGetName, 256, dev)
            name = name.split(b"\0", 1)[0].decode(errors="replace").strip()
            out["devices"].append({
                "name": name,
                "compute_capability": major * 10 + minor,
                "sm_count": sms,
                "shared_memory_per_block": smem,
            })
    except DynamicLibNotFoundError as e:
        out["reason"] = f"no GPU: no CUDA driver ({e})"
        return out
    except Exception as e:  # noqa: BLE001 - a driver without a device, a driver too old, ...
        out["reason"] = f"no GPU: the CUDA driver is not usable here ({type(e).__name__}: {e})"
        return out
    if not out["devices"]:
        out["reason"] = "no GPU: the CUDA driver reports no device"
    return out


def compute_capability() -> int | None:
    """The lowest compute capability (major * 10 + minor) of this host's CUDA GPUs; None
    without one. The one device-capability function of the package."""
    devices = device_query()["devices"]
    return min(d["compute_capability"] for d in devices) if devices else None


def sm_count() -> int | None:
    """Streaming multiprocessors of the first CUDA GPU (None without one)."""
    devices = device_query()["devices"]
    return devices[0]["sm_count"] if devices else None


def shared_memory_per_block() -> int | None:
    """Least opt-in shared memory per block (bytes) of this host's GPUs (None: unknown)."""
    sizes = [d.get("shared_memory_per_block") for d in device_query()["devices"]]
    return min(sizes) if sizes and None not in sizes else None


def _cc_text(cc: int) -> str:  # 90 -> '9.0'
    return f"{cc // 10}.{cc % 10}"


@contextlib.contextmanager
def force_grouped_gemm(choice: str | None):
    """Within the block the grouped GEMM family is `choice` ('auto', 'sm90', 'sm80'; None: no
    change), ahead of $MOE_PRAXIS_GROUPED_GEMM, for the ops called (traced) inside it: each op
    keeps the family it was called with (benchmarks.layer's 'cuda-sm80' beside 'cuda')."""
    if choice not in GROUPED_GEMM_CHOICES + (None, ):
        raise ValueError(
            f"force_grouped_gemm({choice!r}) is invalid; valid: {GROUPED_GEMM_CHOICES}")
    token = _FORCED_GROUPED_GEMM.set(choice or _FORCED_GROUPED_GEMM.get())
    try:
        yield
    finally:
        _FORCED_GROUPED_GEMM.reset(token)


def grouped_gemm_choice() -> str:
    """force_grouped_gemm's, else $MOE_PRAXIS_GROUPED_GEMM's choice (its one reader; unset: auto)"""
    forced = _FORCED_GROUPED_GEMM.get()
    if forced is not None:
        return forced
    value = os.environ.get(ENV_GROUPED_GEMM, "").strip().lower() or "auto"
    if value not in GROUPED_GEMM_CHOICES:
        raise ValueError(f"${ENV_GROUPED_GEMM}={value!r} is invalid; valid: "
                         f"{GROUPED_GEMM_CHOICES} (unset: 'auto')")
    return value


def grouped_gemm_kernel(cc: int | None = None, dtype=None) -> tuple[str, str]:
    """(kernel family, why) of the CUDA grouped GEMM: 'sm90' (Hopper, sm_90a, bf16) on compute
    capability 9.0 (where sm_90a code runs), else 'sm80' (CUTLASS 2.x GemmGrouped, bf16 and
    fp16); fp16 inputs take the sm_80 kernels on a Hopper GPU too. Without a GPU (lowering for
    CUDA on a CPU host) the Hopper family, as on the GPU the kernels were built for first.
    $MOE_PRAXIS_GROUPED_GEMM=sm80 (or sm90) forces a family.

    cc: compute capability (major * 10 + minor; default: this host's lowest, None without a
    GPU); dtype: the inputs' dtype (None: bf16). Whether the family can run on the GPU at all
    is cuda_status('grouped_gemm')'s question."""
    choice = grouped_gemm_choice()
    if choice != "auto":
        how = "force_grouped_gemm" if _FORCED_GROUPED_GEMM.get() else f"${ENV_GROUPED_GEMM}"
        return choice, f"{how}={choice} forces the {choice} kernels"
    cc = compute_capability() if cc is None else cc
    lo, hi = GROUPED_GEMM_KERNELS["sm90"]
    where = f"compute capability {_cc_text(cc)}" if cc else "no GPU (the family of a 9.0 GPU)"
    if cc is None or lo <= cc < hi:
        if dtype is not None and jax.numpy.dtype(dtype) == jax.numpy.float16:
            return "sm80", (f"{where}, fp16 inputs: the Hopper kernels take bf16 only, the sm_80 "
                            "kernels take fp16")
        return "sm90", f"{where}: the Hopper kernels (sm_90a: wgmma, TMA)"
    return "sm80", (f"{where}: the sm_80 kernels (CUTLASS 2.x GemmGrouped, mma.sync); the Hopper "
                    "kernels (sm_90a code) need compute capability 9.0")


def requirement(op: str) -> tuple[int, int | None]:
    """[minimum, first unsupported) compute capability of `op` (COMPUTE_CAPABILITY; the grouped
    GEMM's is its forced kernel family's when $MOE_PRAXIS_GROUPED_GEMM forces one)."""
    name = op.split(".")[0]
    if name == "grouped_gemm" and grouped_gemm_choice() != "auto":
        return GROUPED_GEMM_KERNELS[grouped_gemm_choice()]
    return COMPUTE_CAPABILITY.get(name, DEFAULT_COMPUTE_CAPABILITY)


def fused_gate_up_reason() -> str:
    """'' when the fused gate/up kernel may run beside the chosen grouped GEMM family, else why
    not (it is built on the Hopper kernels: with the sm_80 ones the unfused path runs)."""
    if grouped_gemm_kernel()[0] == "sm90":
        return ""
    return ("the fused gate/up kernel is sm_90a code on the Hopper grouped GEMM, and the sm_80 "
            f"grouped GEMM runs here ({grouped_gemm_kernel()[1]}): the unfused path runs (the "
            "grouped GEMM against w_gate_up, then the SwiGLU kernel)")


def jax_cuda_reason() -> str:
    """'' when JAX runs on a CUDA GPU, else why not: the driver may see a GPU that JAX does not
    use (JAX_PLATFORMS=cpu, a jaxlib without CUDA, a ROCm GPU). Asked when a backend is
    resolved, never at import."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return f"no GPU visible to JAX (default backend: {jax.default_backend()})"
    version = str(getattr(gpus[0].client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return f"the GPU {gpus[0].device_kind!r} is not a CUDA device ({version})"
    return ""


def cuda_status(op: str = "") -> tuple[bool, str]:
    """(usable, reason) for the CUDA kernel of `op` ('' = the library as a whole)."""
    dev = device_query()
    if dev["reason"]:
        return False, dev["reason"]
    jax_reason = jax_cuda_reason()
    if jax_reason:
        return False, jax_reason
    ok, why = library_status()
    if not ok:
        return False, why
    lo, hi = requirement(op)
    ccs = [d["compute_capability"] for d in dev["devices"]]
    name = dev["devices"][0]["name"]
    if min(ccs) < lo or (hi is not None and max(ccs) >= hi):
        need = f">= {_cc_text(lo)}" if hi is None else f"{_cc_text(lo)} to below {_cc_text(hi)}"
        who = f"the {op} kernel needs" if op else "the kernels need"
        return False, (f"{who} compute capability {need}, the GPU {name!r} has "
                       f"{', '.join(_cc_text(c) for c in sorted(set(ccs)))}")
    if op.split(".")[0] == "gate_up_swiglu" and fused_gate_up_reason():
        return False, fused_gate_up_reason()
    return True, f"{why}; GPU {name} (compute capability {_cc_text(min(ccs))})"


def op_kernels() -> dict[str, dict]:
    """Which kernel each op family runs on this host and why: {op: {'kernel', 'reason'}} for
    the ops of COMPUTE_CAPABILITY. 'kernel' is 'cuda' or 'xla' (the reference); for the grouped
    GEMM 'sm90' or 'sm80' (grouped_gemm_kernel); for the fused gate/up 'sm90' (fused) or
    'unfused' (the grouped GEMM, then the SwiGLU kernel) where only the fused kernel cannot
    run. What 'auto' picks; problems a kernel does not take (dtype, shapes) still fall back."""
    out = {}
    gg_ok, _ = cuda_status("grouped_gemm")
    for op in COMPUTE_CAPABILITY:
        ok, why = cuda_status(op)
        if op == "grouped_gemm" and ok:
            kernel, why = grouped_gemm_kernel()
        elif op == "gate_up_swiglu" and ok:
            kernel = "sm90"
        elif op == "gate_up_swiglu" and gg_ok:
            kernel = "unfused"
            if "unfused" not in why:
                why += ("; the unfused path runs (the grouped GEMM against w_gate_up, then the "
                        "SwiGLU kernel)")
        else:
            kernel = "cuda" if ok else "xla"
        out[op] = {"kernel": kernel, "reason": why}
    return out


def backend_info(config=None) -> dict[str, dict]:
    """Which backends are usable here and, for each unusable one, why; and which expert GEMMs
    run in FP8.

    Returns {'xla': {'usable': True, 'reason': ...}, 'cuda': {'usable': bool, 'reason': str,
    'library': path, 'driver_version', 'runtime_version' (CUDA's integer form, e.g. 13000; None
    when unknown), 'devices': [{'name', 'compute_capability', 'sm_count',
    'shared_memory_per_block'}], 'ops': op_kernels()
    (the kernel each op family runs here and why)}, 'fp8_gemms': fp8_rule.backend_entry(config)
    (the per-GEMM rule of MoEConfig.fp8_gemms='auto' and, for an FP8 config, its choices)}.
    """
    ok, why = cuda_status()
    dev = device_query()
    return {
        "xla": {
            "usable": True,
            "reason": "pure-JAX reference, runs on every platform"
        },
        "cuda": {
            "usable": ok,
            "reason": why,
            "library": str(library_path()),
            "driver_version": dev["driver_version"],
            "runtime_version": dev["runtime_version"],
            "devices": [dict(d) for d in dev["devices"]],
            "ops": op_kernels(),
        },
        "fp8_gemms": fp8_rule.backend_entry(config),
    }


def library_state() -> dict:
    """The library loader's state, not loading it: {'attempted', 'loaded', 'reason', 'path'}."""
    return _library.library_state()


def resolve_backend(backend: str, op: str = "") -> str:
    """Maps 'auto' | 'xla' | 'cuda' to the backend that will run `op` ('xla' or 'cuda').

    Called once per block (moe_block) and by an op called directly with 'auto'."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend={backend!r} is invalid; valid: {BACKENDS}")
    if backend == "xla":
        return "xla"
    ok, why = cuda_status(op)
    if backend == "cuda" and not ok:
        raise RuntimeError(f"kernel_backend='cuda' requested for {op or 'an op'} but {why}")
    return "cuda" if ok else "xla"


def op_backend(backend: str, op: str) -> str:
    """The backend an op runs: 'auto' is resolved here (the op was called directly); 'xla' and
    'cuda' are taken as resolved. With 'cuda' the op's own compute-capability requirement is
    checked: unmet, the op falls back to 'xla' with a warning (once); with no usable GPU or
    library at all, 'cuda' raises as resolve_backend does."""
    if backend == "auto":
        return resolve_backend(backend, op)
    if backend == "xla":
        return "xla"
    if backend != "cuda":
        raise ValueError(f"kernel_backend={backend!r} is invalid; valid: {BACKENDS}")
    ok, why = cuda_status(op)
    if ok:
        return "cuda"
    if not cuda_status()[0]:
        raise RuntimeError(f"kernel_backend='cuda' requested for {op} but {why}")
    warn_fallback(op, why)
    return "xla"


_warned: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warns once per distinct message: the one warn-once of moe_praxis."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, category, stacklevel=3)


def warn_fallback(op: str, why: str) -> None:
    """Warns once per (op, reason) that the CUDA kernel of `op` is not used and why."""
    warn_once(f"moe_praxis: {op} runs the XLA reference instead of the CUDA kernel: {why}")


def jax_platform() -> str:
    """JAX's default backend ('cpu', 'gpu', ...): where an XLA fallback would run."""
    return jax.default_backend()


def warn_xla_on_gpu(op: str, why: str) -> None:
    """Warns once per (op, reason) where `op` runs jax.lax.ragged_dot on a GPU: XLA:GPU expands
    it into a dense, masked problem E times the useful work (E: the experts)."""
    if jax_platform() == "gpu":
        warn_once(f"moe_praxis: {op} runs jax.lax.ragged_dot on a GPU ({why}); XLA:GPU computes "
                  "and stores E times the useful work (a dense, masked problem over all E "
                  "experts): about E times the time and memory of a grouped GEMM kernel")


def reset_warnings() -> None:
    """Forgets which warnings were given (tests that check a warning is given)."""
    _warned.clear()
