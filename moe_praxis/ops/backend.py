"""Backend selection for the primitives: 'auto' | 'xla' | 'cuda'.

'auto' uses a CUDA kernel only on a GPU where the kernel library loaded and the kernel
supports the device; otherwise the pure-JAX ('xla') reference. Asking for 'cuda' where it is
not usable raises an error that says why.
"""

from __future__ import annotations

import jax

BACKENDS = ("auto", "xla", "cuda")


def _cuda_status() -> tuple[bool, str]:
    """(usable, reason) for the CUDA kernel library."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return False, f"no GPU visible to JAX (default backend: {jax.default_backend()})"
    return False, "the CUDA kernel library is not built (python -m moe_praxis.build_kernels)"


def backend_info() -> dict[str, dict]:
    """Which backends are usable here and, for each unusable one, why."""
    ok, why = _cuda_status()
    return {
        "xla": {"usable": True, "reason": "pure-JAX reference, runs on every platform"},
        "cuda": {"usable": ok, "reason": why},
    }


def resolve_backend(backend: str, op: str = "") -> str:
    """Maps 'auto' | 'xla' | 'cuda' to the backend that will run `op`."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend={backend!r} is invalid; valid: {BACKENDS}")
    if backend == "xla":
        return "xla"
    ok, why = _cuda_status()
    if backend == "cuda" and not ok:
        raise RuntimeError(f"kernel_backend='cuda' requested for {op or 'an op'} but {why}")
    return "cuda" if ok else "xla"
