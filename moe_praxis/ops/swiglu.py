"""Expert activations: SwiGLU (and the other gated / plain activations Praxis uses).

    swiglu(gate, up, w) = silu(gate) * up * w[:, None]     (w optional: the routing weight)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_praxis.ops import cuda
from moe_praxis.ops.backend import resolve_backend

_ACTS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
}


def activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"activation={name!r} is invalid; valid: {tuple(_ACTS)}")
    return _ACTS[name]


def swiglu_reference(gate, up, weights=None, *, act: str = "silu"):
    """gate, up: [R, H]; weights: optional [R]. Computed in float32, returned in gate.dtype."""
    out = activation(act)(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    if weights is not None:
        out = out * weights.astype(jnp.float32)[:, None]
    return out.astype(gate.dtype)


def swiglu(gate, up, weights=None, *, act: str = "silu", backend: str = "auto"):
    """Gated activation `act(gate) * up` (times an optional per-row weight).

    gate, up: [R, H]; weights: optional [R]. backend 'cuda' runs the fused SwiGLU kernels
    (ops.cuda.swiglu: act='silu', float32 / bfloat16; otherwise the reference, with a warning).
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {gate.shape} and {up.shape}")
    if weights is not None and weights.shape != gate.shape[:1]:
        raise ValueError(f"weights must be [R={gate.shape[0]}], got {weights.shape}")
    if resolve_backend(backend, "swiglu") == "cuda":
        why = cuda.swiglu_unsupported(gate, act)
        if not why:
            return cuda.swiglu(gate, up, weights)
        cuda.warn_fallback("swiglu", why)
    return swiglu_reference(gate, up, weights, act=act)
