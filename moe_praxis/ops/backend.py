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

The device is queried through cuda-python (`cuda.bindings.driver`): compute capability, SM
count, driver and runtime versions, without initialising a JAX backend. Without a CUDA driver
(or without cuda-python) the query degrades to a reason ("no GPU: ...").

This module is also the library layer's public face: tests and tools read `KERNELS`, the
environment variable, `library_state()` and `call_stats()` here.
"""

from __future__ import annotations

import functools
import warnings

import jax

from moe_praxis.ops import _library
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
# they cannot run) (None: no upper bound). The grouped GEMMs (and the fused gate/up GEMM) are
# sm_90a code (wgmma, TMA), which runs on 9.x only; the other kernels are sm_80 machine code
# plus compute_80 PTX that newer GPUs compile at load time.
COMPUTE_CAPABILITY: dict[str, tuple[int, int | None]] = {
    "grouped_gemm": (90, 100),
    "gate_up_swiglu": (90, 100),
}
DEFAULT_COMPUTE_CAPABILITY: tuple[int, int | None] = (80, None)


def _call(fn, *args):
    """A cuda.bindings call: its values, or RuntimeError naming the CUresult."""
    err, *values = fn(*args)
    if int(err) != 0:
        raise RuntimeError(f"{fn.__name__} failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def device_query() -> dict:
    """The CUDA devices as the driver sees them (cached; no JAX backend is initialised).

    {'reason': '' or why there is no usable GPU, 'driver_version': int or None,
    'runtime_version': int or None, 'devices': [{'name', 'compute_capability' (major*10+minor),
    'sm_count'}]}.
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
            major, minor, sms = (int(_call(_driver.cuDeviceGetAttribute, a, dev))
                                 for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                           attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                           attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
            name = _call(_driver.cuDeviceGetName, 256, dev)
            name = name.split(b"\0", 1)[0].decode(errors="replace").strip()
            out["devices"].append({
                "name": name,
                "compute_capability": major * 10 + minor,
                "sm_count": sms
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


def _cc_text(cc: int) -> str:
    return f"{cc // 10}.{cc % 10}"


def requirement(op: str) -> tuple[int, int | None]:
    """[minimum, first unsupported) compute capability of `op` (COMPUTE_CAPABILITY)."""
    return COMPUTE_CAPABILITY.get(op.split(".")[0], DEFAULT_COMPUTE_CAPABILITY)


def _jax_cuda_reason() -> str:
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
    jax_reason = _jax_cuda_reason()
    if jax_reason:
        return False, jax_reason
    ok, why = _library.library_status()
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
    return True, f"{why}; GPU {name} (compute capability {_cc_text(min(ccs))})"


def backend_info() -> dict[str, dict]:
    """Which backends are usable here and, for each unusable one, why.

    Returns {'xla': {'usable': True, 'reason': ...}, 'cuda': {'usable': bool, 'reason': str,
    'library': path, 'driver_version', 'runtime_version' (CUDA's integer form, e.g. 13000; None
    when unknown), 'devices': [{'name', 'compute_capability', 'sm_count'}]}}.
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
        },
    }


def library_state() -> dict:
    """The kernel library loader's state without loading it: {'attempted', 'loaded', 'reason',
    'path'}."""
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


def reset_warnings() -> None:
    """Forgets which warnings were given (tests that check a warning is given)."""
    _warned.clear()
