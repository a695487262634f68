"""Expert activations: SwiGLU (and the other gated / plain activations Praxis uses).

    swiglu(gate, up, w) = silu(gate) * up * w[:, None]     (w optional: the routing weight)

CUDA side (kernels/swiglu.cu): `swiglu_cuda`, a custom_vjp whose forward and backward are each
a `platform_call` of the kernel and the reference; `swiglu_bwd_ffi` is the backward kernel,
also used by the fused gate/up op (ops.gate_up) in its interleaved form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.vma import vary_together

_ACTS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
}
ACTIVATIONS = tuple(_ACTS)  # MoEConfig.activation's valid values


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


def named_gate_up(gate, up):
    """(gate, up) under the MoE block's checkpoint names 'moe_gate' and 'moe_up', which the
    remat policies of moe_praxis.praxis.remat save; gate may be None (not gated). The fused ops
    name their gate and up residuals with it inside their custom_vjp forward rules."""
    return (None if gate is None else checkpoint_name(gate, "moe_gate")), checkpoint_name(
        up, "moe_up")


# ------------------------------------------------------------------------------ CUDA side


def no_weights():
    """The routing-weight operand of the kernels that take optional weights (has_weight=False):
    one float32 element, never read. Not a zero-size array: with the 'ragged' exchange, the GPU
    compiler's SPMD partitioner crashed on a zero-size placeholder, as it did on a varying-cast
    one (a psum of the zero-size cotangent)."""
    return jnp.zeros((1, ), jnp.float32)


def _float_ok(*xs) -> bool:
    return all(x.dtype in (jnp.float32, jnp.bfloat16) for x in xs)


def _ref(gate, up, w, has_weight):
    return swiglu_reference(gate, up, w if has_weight else None, act="silu")


def _fwd_ffi(gate, up, w, has_weight):
    return ffi("moe_swiglu_fwd",
               jax.ShapeDtypeStruct(gate.shape, gate.dtype),
               gate,
               up,
               w,
               has_weight=has_weight)


def swiglu_bwd_reference(gate, up, weights, dout):
    """(dgate, dup, dw) of swiglu_reference (silu) at cotangent dout: autodiff of the
    reference, dgate and dup in gate.dtype, dw in weights' dtype (None without weights)."""
    if weights is None:
        _, vjp = jax.vjp(lambda g, u: swiglu_reference(g, u), gate, up)
        return vjp(dout) + (None, )
    _, vjp = jax.vjp(lambda g, u, ww: swiglu_reference(g, u, ww), gate, up, weights)
    return vjp(dout)


def _bwd_ref(gate, up, w, dout, has_weight):
    dg, du, dw = swiglu_bwd_reference(gate, up, w if has_weight else None, dout)
    return dg, du, dw if has_weight else jnp.zeros_like(w)


def swiglu_bwd_ffi(gate, up, w, dout, has_weight, interleaved=False):
    """The SwiGLU backward kernel: (dgate, dup, dw), or with interleaved=True (dgate_up [R, 2H],
    column 2j d gate j, 2j + 1 d up j: the fused gate/up layout, ops.gate_up) and dw."""
    r, h = gate.shape
    dw = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    if interleaved:
        return tuple(
            ffi("moe_swiglu_bwd_interleaved", (jax.ShapeDtypeStruct((r, 2 * h), gate.dtype), dw),
                gate,
                up,
                w,
                dout,
                has_weight=has_weight))
    out = (jax.ShapeDtypeStruct(gate.shape, gate.dtype), jax.ShapeDtypeStruct(up.shape,
                                                                              up.dtype), dw)
    return tuple(ffi("moe_swiglu_bwd", out, gate, up, w, dout, has_weight=has_weight))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _swiglu(gate, up, w, has_weight):
    return platform_call(functools.partial(_fwd_ffi, has_weight=has_weight),
                         functools.partial(_ref, has_weight=has_weight), gate, up, w)


def _swiglu_vjp_fwd(gate, up, w, has_weight):
    return _swiglu(gate, up, w, has_weight), (gate, up, w)


def _swiglu_vjp_bwd(has_weight, res, dout):
    gate, up, w = res
    dg, du, dw = platform_call(functools.partial(swiglu_bwd_ffi, has_weight=has_weight),
                               functools.partial(_bwd_ref, has_weight=has_weight), gate, up, w,
                               dout)
    return dg, du, dw if has_weight else jnp.zeros_like(w)


_swiglu.defvjp(_swiglu_vjp_fwd, _swiglu_vjp_bwd)


def swiglu_unsupported(gate, act: str) -> str:
    """'' if the SwiGLU kernel handles these inputs, else why not."""
    if act != "silu":
        return f"act={act!r} (the kernel fuses silu only)"
    if gate.ndim != 2:
        return f"gate must be [R, H], got shape {gate.shape}"
    if not _float_ok(gate):
        return f"dtype {gate.dtype} (float32 / bfloat16 only)"
    return ""


def swiglu_cuda(gate, up, weights=None):
    """The SwiGLU kernels (the reference where not lowered for CUDA): silu(gate) * up
    (* weights[:, None]); gate, up: [R, H] f32 or bf16 (one dtype); weights: optional [R]
    (gradient returned in its dtype). Output in gate.dtype."""
    up = up.astype(gate.dtype)
    # Inside shard_map the inputs get one type (vary_together): e.g. weights that vary over
    # fewer axes than the rows get their gradient summed over the others. Without weights the
    # kernels get no_weights(), left alone (its cotangent is zeros of its own type).
    if weights is None:
        return _swiglu(*vary_together(gate, up), no_weights(), False)
    # autodiff of the cast returns the weights' gradient in their own dtype
    return _swiglu(*vary_together(gate, up, weights.astype(jnp.float32)), True)


def swiglu(gate, up, weights=None, *, act: str = "silu", backend: str = "auto"):
    """Gated activation `act(gate) * up` (times an optional per-row weight).

    gate, up: [R, H]; weights: optional [R]. backend 'cuda' runs the fused SwiGLU kernels
    (swiglu_cuda: act='silu', float32 / bfloat16; otherwise the reference, with a warning).
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {gate.shape} and {up.shape}")
    if weights is not None and weights.shape != gate.shape[:1]:
        raise ValueError(f"weights must be [R={gate.shape[0]}], got {weights.shape}")
    if _backend.op_backend(backend, "swiglu") == "cuda":
        why = swiglu_unsupported(gate, act)
        if not why:
            return swiglu_cuda(gate, up, weights)
        _backend.warn_fallback("swiglu", why)
    return swiglu_reference(gate, up, weights, act=act)
