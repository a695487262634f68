"""Loader of the CUDA kernel library and the CUDA side of the primitives.

The ONE table of FFI handlers is `KERNELS` (XLA custom-call target name -> symbol exported by
``libmoe_praxis_kernels.so``). On import, if the library exists, it is opened with ctypes and
every handler in the table is registered with
``jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="CUDA")``.
The build (``python -m moe_praxis.build_kernels``) checks that the library exports every symbol
of this table. To add a kernel: define it with ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` in a
``kernels/*.cu`` file and add one line here.

Library location: ``$MOE_PRAXIS_KERNEL_LIB`` if set, else ``moe_praxis/lib/libmoe_praxis_kernels.so``.

Every CUDA primitive is called through `platform_dependent`: one traced function whose CUDA
branch is the FFI call and whose default branch is the pure-JAX reference, so the same code runs
on the CPU (reference) and on the GPU (kernel) up to the primitive.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Optional

import jax
import numpy as np

ENV_LIB = "MOE_PRAXIS_KERNEL_LIB"
LIB_NAME = "libmoe_praxis_kernels.so"
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "lib" / LIB_NAME

# XLA FFI target name -> exported handler symbol. The one table of kernels.
KERNELS: dict[str, str] = {
    "moe_aux_loss_fwd": "MoeAuxLossFwd",
    "moe_aux_loss_bwd": "MoeAuxLossBwd",
    "moe_router_fwd": "MoeRouterFwd",
    "moe_router_bwd": "MoeRouterBwd",
    "moe_swiglu_fwd": "MoeSwigluFwd",
    "moe_swiglu_bwd": "MoeSwigluBwd",
    "moe_permute": "MoePermute",
    "moe_unpermute": "MoeUnpermute",
    "moe_grouped_gemm_fwd": "MoeGroupedGemmFwd",
    "moe_grouped_gemm_dgrad": "MoeGroupedGemmDgrad",
    "moe_grouped_gemm_wgrad": "MoeGroupedGemmWgrad",
}

# Minimum compute capability (major * 10 + minor) per op family; ops not listed need 8.0.
MIN_COMPUTE_CAPABILITY: dict[str, int] = {
    "grouped_gemm": 90,  # sm_90a CUTLASS kernels (ops/grouped_gemm.py also needs 9.x)
}
DEFAULT_MIN_COMPUTE_CAPABILITY = 80


def library_path() -> Path:
    """$MOE_PRAXIS_KERNEL_LIB if set, else moe_praxis/lib/libmoe_praxis_kernels.so."""
    env = os.environ.get(ENV_LIB)
    return Path(env).expanduser().resolve() if env else DEFAULT_LIB


class _State:
    loaded: bool = False
    reason: str = "not loaded yet"
    path: Optional[Path] = None
    lib: Optional[ctypes.CDLL] = None


_state = _State()


def load_library(path: Optional[os.PathLike] = None, *, force: bool = False) -> tuple[bool, str]:
    """Opens the library and registers every handler in KERNELS for platform CUDA.

    Returns (loaded, reason): reason says where it was loaded from, or why it was not (file
    missing, ctypes failed to open it, a symbol missing). Idempotent unless `force`.
    """
    if _state.loaded and not force and path is None:
        return True, _state.reason
    p = Path(path) if path is not None else library_path()
    _state.path = p
    if not p.is_file():
        how = (f"${ENV_LIB}={os.environ[ENV_LIB]}" if os.environ.get(ENV_LIB) else
               f"the default location (set ${ENV_LIB} to use another)")
        _state.loaded, _state.reason = False, (
            f"the CUDA kernel library is not built: {p} does not exist ({how}); build it with "
            "`python -m moe_praxis.build_kernels`")
        return False, _state.reason
    try:
        lib = ctypes.CDLL(str(p))
    except OSError as e:
        _state.loaded, _state.reason = False, f"cannot open the CUDA kernel library {p}: {e}"
        return False, _state.reason
    missing = [sym for sym in KERNELS.values() if not hasattr(lib, sym)]
    if missing:
        _state.loaded, _state.reason = False, (
            f"the CUDA kernel library {p} lacks the symbols {missing}; rebuild it with "
            "`python -m moe_praxis.build_kernels`")
        return False, _state.reason
    try:
        for name, sym in KERNELS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, sym)),
                                        platform="CUDA")
    except Exception as e:  # noqa: BLE001 - registration failures become a reason
        _state.loaded, _state.reason = False, f"registering the FFI targets failed: {e}"
        return False, _state.reason
    _state.lib = lib
    _state.loaded, _state.reason = True, f"loaded from {p}"
    return True, _state.reason


def library_status() -> tuple[bool, str]:
    """(loaded, reason) of the last load attempt (loads once if never tried)."""
    if not _state.loaded and _state.path is None:
        load_library()
    return _state.loaded, _state.reason


def min_compute_capability(op: str) -> int:
    family = op.split(".")[0]
    return MIN_COMPUTE_CAPABILITY.get(family, DEFAULT_MIN_COMPUTE_CAPABILITY)


# ------------------------------------------------------------------------- calling helpers


def ffi(name: str, results, *args, **attrs):
    """jax.ffi.ffi_call of target `name` (must be in KERNELS); Python floats become f32
    attributes, ints and bools int64 / bool attributes."""
    if name not in KERNELS:
        raise KeyError(f"FFI target {name!r} is not in moe_praxis.ops.cuda.KERNELS "
                       f"(known: {sorted(KERNELS)})")
    conv = {}
    for k, v in attrs.items():
        if isinstance(v, bool):
            conv[k] = v
        elif isinstance(v, (int, np.integer)):
            conv[k] = np.int64(v)
        elif isinstance(v, (float, np.floating)):
            conv[k] = np.float32(v)
        else:
            conv[k] = v
    return jax.ffi.ffi_call(name, results, vmap_method="sequential")(*args, **conv)


def platform_call(cuda_fn: Callable, reference_fn: Callable, *args):
    """One function for CPU and GPU: `cuda_fn(*args)` when lowered for CUDA, else
    `reference_fn(*args)` (the pure-JAX reference, same signature and outputs)."""
    return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=reference_fn)


load_library()
