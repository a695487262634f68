"""Backend selection for the primitives: 'auto' | 'xla' | 'cuda'.

'auto' uses a CUDA kernel only on a GPU where the kernel library loaded and the kernel
supports the device (compute capability >= the op's minimum, see
`moe_praxis.ops.cuda.MIN_COMPUTE_CAPABILITY`); otherwise the pure-JAX ('xla') reference.
Asking for 'cuda' where it is not usable raises an error that says why.
"""

from __future__ import annotations

import jax

from moe_praxis.ops import cuda as _cuda

BACKENDS = ("auto", "xla", "cuda")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _compute_capability(dev) -> int:
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return 0
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


def _cuda_status(op: str = "") -> tuple[bool, str]:
    """(usable, reason) for the CUDA kernel of `op` ('' = the library as a whole)."""
    gpus = _gpus()
    if not gpus:
        return False, f"no GPU visible to JAX (default backend: {jax.default_backend()})"
    version = str(getattr(gpus[0].client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return False, f"the GPU {gpus[0].device_kind!r} is not a CUDA device ({version})"
    ok, why = _cuda.library_status()
    if not ok:
        return False, why
    need = _cuda.min_compute_capability(op)
    have = min(_compute_capability(d) for d in gpus)
    if have < need:
        return False, (
            f"{op or 'the kernels'} need compute capability >= {need // 10}.{need % 10}, "
            f"the GPU {gpus[0].device_kind!r} has {have // 10}.{have % 10}")
    return True, f"{why}; GPU {gpus[0].device_kind} (compute capability {have // 10}.{have % 10})"


def backend_info() -> dict[str, dict]:
    """Which backends are usable here and, for each unusable one, why.

    Returns {'xla': {'usable': True, 'reason': ...}, 'cuda': {'usable': bool, 'reason': str,
    'library': path}}.
    """
    ok, why = _cuda_status()
    return {
        "xla": {
            "usable": True,
            "reason": "pure-JAX reference, runs on every platform"
        },
        "cuda": {
            "usable": ok,
            "reason": why,
            "library": str(_cuda.library_path())
        },
    }


def resolve_backend(backend: str, op: str = "") -> str:
    """Maps 'auto' | 'xla' | 'cuda' to the backend that will run `op` ('xla' or 'cuda')."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend={backend!r} is invalid; valid: {BACKENDS}")
    if backend == "xla":
        return "xla"
    ok, why = _cuda_status(op)
    if backend == "cuda" and not ok:
        raise RuntimeError(f"kernel_backend='cuda' requested for {op or 'an op'} but {why}")
    return "cuda" if ok else "xla"
