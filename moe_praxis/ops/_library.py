"""The kernel library: where it is, loading it on first use, and calling its FFI targets.

Private to ``moe_praxis.ops`` (the backend layer re-exports what tests and tools need). The
ONE table of FFI handlers is `KERNELS` (XLA custom-call target name -> symbol exported by
``libmoe_praxis_kernels.so``). The library is opened with ctypes and every handler in the table
is registered with ``jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol),
platform="CUDA")`` the first time something needs it (a CUDA op being traced, or the backend
layer asking whether CUDA is usable), never at import: ``import moe_praxis`` loads no shared
library. The build (``python -m moe_praxis.build_kernels``) uses the same table, path and
environment variable, and checks that the library exports every symbol of the table. To add a
kernel: define it with ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` in a ``kernels/*.cu`` file and add one
line here.

Library location: ``$MOE_PRAXIS_KERNEL_LIB`` if set, else
``moe_praxis/lib/libmoe_praxis_kernels.so``.

Every CUDA primitive is called through `platform_call`: one traced function whose CUDA branch is
the FFI call and whose default branch is the pure-JAX reference, so the same code runs on the
CPU (reference) and on the GPU (kernel) up to the primitive.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Optional

import jax
import numpy as np

from moe_praxis.ops.vma import vary, varying_axes

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
    "moe_swiglu_bwd_interleaved": "MoeSwigluBwdInterleaved",
    "moe_permute": "MoePermute",
    "moe_unpermute": "MoeUnpermute",
    "moe_permute_index": "MoePermuteIndex",
    "moe_permute_indexed": "MoePermuteIndexed",
    "moe_unpermute_indexed": "MoeUnpermuteIndexed",
    "moe_expert_sort": "MoeExpertSort",
    "moe_combine_fwd": "MoeCombineFwd",
    "moe_combine_bwd": "MoeCombineBwd",
    "moe_grouped_gemm_fwd": "MoeGroupedGemmFwd",
    "moe_grouped_gemm_dgrad": "MoeGroupedGemmDgrad",
    "moe_grouped_gemm_wgrad": "MoeGroupedGemmWgrad",
    "moe_grouped_gemm_swiglu_fwd": "MoeGroupedGemmSwigluFwd",
    "moe_grouped_gemm_dswiglu": "MoeGroupedGemmDswiglu",
    "moe_grouped_gemm_dswiglu_interleaved": "MoeGroupedGemmDswigluInterleaved",
    "moe_grouped_gemm_sm80_fwd": "MoeGroupedGemmSm80Fwd",
    "moe_grouped_gemm_sm80_dgrad": "MoeGroupedGemmSm80Dgrad",
    "moe_grouped_gemm_sm80_wgrad": "MoeGroupedGemmSm80Wgrad",
    "moe_grouped_gemm_fp8_nt": "MoeGroupedGemmFp8Nt",
    "moe_grouped_gemm_fp8_wgrad": "MoeGroupedGemmFp8Wgrad",
    "moe_grouped_gemm_fp8_wgrad_f32": "MoeGroupedGemmFp8WgradF32",
    "moe_fp8_quantize_rows": "MoeFp8QuantizeRows",
    "moe_fp8_quantize_weight": "MoeFp8QuantizeWeight",
    "moe_fp8_quantize_rows_grouped_t": "MoeFp8QuantizeRowsGroupedT",
    "moe_swiglu_fwd_fp8": "MoeSwigluFwdFp8",
    "moe_permute_fp8": "MoePermuteFp8",
    "moe_swiglu_bwd_fp8": "MoeSwigluBwdFp8",
}


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
    _state.path, _state.lib = p, None
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
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, sym)), platform="CUDA")
    except Exception as e:  # noqa: BLE001 - registration failures become a reason
        _state.loaded, _state.reason = False, f"registering the FFI targets failed: {e}"
        return False, _state.reason
    _state.lib = lib
    _state.loaded, _state.reason = True, f"loaded from {p}"
    return True, _state.reason


def library_status() -> tuple[bool, str]:
    """(loaded, reason) of the last load attempt; the first call makes the attempt."""
    if not _state.loaded and _state.path is None:
        load_library()
    return _state.loaded, _state.reason


def library_state() -> dict:
    """What the loader knows, without loading: {'attempted', 'loaded', 'reason', 'path'}."""
    return {
        "attempted": _state.path is not None,
        "loaded": _state.loaded,
        "reason": _state.reason,
        "path": None if _state.path is None else str(_state.path),
    }


def call_stats() -> dict:
    """Grouped GEMM handler calls so far in this process, and how many of them ran while XLA
    was capturing their stream into a CUDA graph (command buffer); for tests and debugging.
    Raises RuntimeError when the library is not loaded."""
    if _state.lib is None:
        raise RuntimeError(f"the CUDA kernel library is not loaded: {_state.reason}")
    out = {}
    for key, sym in (("calls", "moe_praxis_stream_calls"), ("captured",
                                                            "moe_praxis_captured_calls")):
        fn = getattr(_state.lib, sym)
        fn.restype = ctypes.c_longlong
        out[key] = int(fn())
    return out


# ------------------------------------------------------------------------- calling helpers


def ffi(name: str, results, *args, **attrs):
    """jax.ffi.ffi_call of target `name` (must be in KERNELS); Python floats become f32
    attributes, ints and bools int64 / bool attributes. The first call loads and registers the
    library; a library that is not there is no error here (lowering for the CPU never uses the
    target; the backend layer says why CUDA is unusable)."""
    if name not in KERNELS:
        raise KeyError(f"FFI target {name!r} is not in moe_praxis.ops.backend.KERNELS "
                       f"(known: {sorted(KERNELS)})")
    library_status()
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


def _match_vma(fn: Callable, vma: frozenset) -> Callable:
    """fn with every output marked varying over the manual axes `vma` (inside shard_map an FFI
    call's outputs carry no varying axes while the reference's do; the branches must agree)."""

    def wrapped(*args):
        return jax.tree.map(lambda o: vary(o, vma), fn(*args))

    return wrapped


def platform_call(cuda_fn: Callable, reference_fn: Callable, *args):
    """One function for CPU and GPU: `cuda_fn(*args)` when lowered for CUDA, else
    `reference_fn(*args)` (the pure-JAX reference, same signature and outputs)."""
    vma = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))
    if vma:
        cuda_fn, reference_fn = _match_vma(cuda_fn, vma), _match_vma(reference_fn, vma)
    return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=reference_fn)
