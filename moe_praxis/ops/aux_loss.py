"""The switch load-balancing loss as a custom_vjp primitive.

    L = coeff * E / (k * T^2) * sum_e (sum_t p[t, e]) * f[e]

p: [T_rows, E] dense routing probabilities; f: [E] number of token copies routed to each
expert; T the number of tokens (by default the rows of p; pass `num_tokens` when rows are
padding, or when p is one shard of a global batch whose f and T are global: the shards'
losses then add up to the global loss); k = top_k. Balanced routing gives L = coeff.

    dL/dp[t, e] = g * coeff * E / (k * T^2) * f[e]

The cotangent g of the scalar loss is rank 0 and stays rank 0 (never reshaped to [1]: a
rank-1 cotangent breaks Shardy lowering of a sharded primitive whose rule declares it
rank 0). f and T are counts and get no gradient.

CUDA side (kernels/aux_loss.cu): `aux_loss_cuda`, a custom_vjp whose forward and backward are
custom_partitioning primitives (the shards' losses are summed; the backward's Shardy rule keeps
the cotangent rank 0), each a `platform_call` of the FFI kernel and the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.vma import zero_cotangent


def aux_loss_scale(num_tokens, num_experts: int, top_k: int, coeff: float):
    """coeff * E / (k * T^2) as a float32 scalar (T may be traced)."""
    t = jnp.asarray(num_tokens, jnp.float32)
    return coeff * num_experts / (top_k * t * t)


def aux_loss_reference(probs, tokens_per_expert, *, top_k: int, coeff: float, num_tokens=None):
    """Pure-JAX forward: float32 scalar. probs: [T, E]; tokens_per_expert: [E]."""
    t = probs.shape[0] if num_tokens is None else num_tokens
    p = probs.astype(jnp.float32)
    f = tokens_per_expert.astype(jnp.float32)
    return aux_loss_scale(t, probs.shape[1], top_k, coeff) * jnp.sum(jnp.sum(p, axis=0) * f)


def aux_loss_bwd_reference(g,
                           probs,
                           tokens_per_expert,
                           *,
                           top_k: int,
                           coeff: float,
                           num_tokens=None):
    """dL/dp: [T, E] in probs.dtype; g is the rank-0 cotangent."""
    if jnp.ndim(g) != 0:
        raise ValueError(f"aux-loss cotangent must be rank 0, got shape {jnp.shape(g)}")
    t = probs.shape[0] if num_tokens is None else num_tokens
    f = tokens_per_expert.astype(jnp.float32)
    row = g.astype(jnp.float32) * aux_loss_scale(t, probs.shape[1], top_k, coeff) * f
    # ones_like keeps probs' sharding (a plain broadcast would be replicated, which an
    # Explicit-sharding mesh rejects as the cotangent of a sharded input).
    return (row[None, :] * jnp.ones_like(probs, dtype=jnp.float32)).astype(probs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _aux_loss(probs, tokens_per_expert, num_tokens, top_k, coeff):
    return aux_loss_reference(probs,
                              tokens_per_expert,
                              top_k=top_k,
                              coeff=coeff,
                              num_tokens=num_tokens)


def _fwd(probs, tokens_per_expert, num_tokens, top_k, coeff):
    out = _aux_loss(probs, tokens_per_expert, num_tokens, top_k, coeff)
    return out, (probs, tokens_per_expert, num_tokens)


def _bwd(top_k, coeff, res, g):
    probs, tpe, t = res
    dp = aux_loss_bwd_reference(g, probs, tpe, top_k=top_k, coeff=coeff, num_tokens=t)
    return dp, zero_cotangent(tpe), zero_cotangent(t)


_aux_loss.defvjp(_fwd, _bwd)

# ------------------------------------------- CUDA: custom_partitioning with a Shardy rule


def _aux_fwd_ref(probs, f, scale):
    return scale * jnp.sum(jnp.sum(probs.astype(jnp.float32), axis=0) * f.astype(jnp.float32))


# The forward's workspace: one float32 partial sum per block of its first pass, added in a fixed
# order by its second (kMaxPartials in kernels/aux_loss.cu): the loss is bitwise reproducible.
AUX_PARTIALS = 512


def _aux_fwd_ffi(probs, f, scale):
    loss, _ = ffi("moe_aux_loss_fwd", (jax.ShapeDtypeStruct(
        (), jnp.float32), jax.ShapeDtypeStruct((AUX_PARTIALS, ), jnp.float32)), probs, f, scale)
    return loss


def _aux_bwd_ref(g, probs, f, scale):
    row = g * scale * f.astype(jnp.float32)
    return jnp.broadcast_to(row[None, :], probs.shape).astype(probs.dtype)


def _aux_bwd_ffi(g, probs, f, scale):
    return ffi("moe_aux_loss_bwd", jax.ShapeDtypeStruct(probs.shape, probs.dtype), g, probs, f,
               scale)


def _aux_fwd_local(probs, f, scale):
    return platform_call(_aux_fwd_ffi, _aux_fwd_ref, probs, f, scale)


def _aux_bwd_local(g, probs, f, scale):
    return platform_call(_aux_bwd_ffi, _aux_bwd_ref, g, probs, f, scale)


def _spec_axes(spec) -> tuple:
    axes = []
    for entry in spec:
        if entry is None:
            continue
        axes += list(entry) if isinstance(entry, tuple) else [entry]
    return tuple(axes)


def _probs_spec(sharding, ndim=2):
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None, ) * (ndim - len(spec))


def _aux_fwd_partition(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[0].sharding)
    axes = _spec_axes((t_spec, e_spec))

    def lower(probs, f, scale):
        loss = _aux_fwd_local(probs, f, scale)
        return jax.lax.psum(loss, axes) if axes else loss

    args = (NamedSharding(mesh, P(t_spec,
                                  e_spec)), NamedSharding(mesh,
                                                          P(e_spec)), NamedSharding(mesh, P()))
    return mesh, lower, NamedSharding(mesh, P()), args


def _aux_fwd_infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P())


def _aux_bwd_partition(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[1].sharding)
    probs_sharding = NamedSharding(mesh, P(t_spec, e_spec))
    args = (NamedSharding(mesh,
                          P()), probs_sharding, NamedSharding(mesh,
                                                              P(e_spec)), NamedSharding(mesh, P()))
    return mesh, _aux_bwd_local, probs_sharding, args


def _aux_bwd_infer(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[1].sharding)
    return NamedSharding(mesh, P(t_spec, e_spec))


# probs [T, E], f [E], scale [] -> loss []: T and E are reduced (psum of the shard losses).
aux_loss_fwd_p = custom_partitioning(_aux_fwd_local)
aux_loss_fwd_p.def_partition(partition=_aux_fwd_partition,
                             infer_sharding_from_operands=_aux_fwd_infer,
                             sharding_rule="t e, e, -> ",
                             reduction_factors=("t", "e"))
# g [] (the rank-0 cotangent, never reshaped), probs [T, E], f [E], scale [] -> dprobs [T, E].
aux_loss_bwd_p = custom_partitioning(_aux_bwd_local)
aux_loss_bwd_p.def_partition(partition=_aux_bwd_partition,
                             infer_sharding_from_operands=_aux_bwd_infer,
                             sharding_rule=", t e, e, -> t e")

# custom_partitioning has no batching rule; under vmap (the per-sequence loss) map sequentially.
_aux_fwd_batched = jax.custom_batching.sequential_vmap(lambda p, f, s: aux_loss_fwd_p(p, f, s))
_aux_bwd_batched = jax.custom_batching.sequential_vmap(
    lambda g, p, f, s: aux_loss_bwd_p(g, p, f, s))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def aux_loss_cuda(probs, tokens_per_expert, num_tokens, top_k: int, coeff: float):
    """CUDA aux loss (float32 scalar); same math as aux_loss_reference (the reference runs in
    the kernel's place where not lowered for CUDA).

    probs: [T, E]; tokens_per_expert: [E]; num_tokens: rank-0 count T.
    """
    return _aux_fwd_batched(probs, *_aux_consts(probs, tokens_per_expert, num_tokens, top_k, coeff))


def _aux_consts(probs, tpe, num_tokens, top_k, coeff):
    scale = aux_loss_scale(num_tokens, probs.shape[-1], top_k, coeff)
    # the kernels read int32 or float32 counts as they are (no convert kernel before the call)
    f = tpe if tpe.dtype in (jnp.int32, jnp.float32) else tpe.astype(jnp.float32)
    return f, scale.astype(jnp.float32)


def _aux_loss_vjp_fwd(probs, tpe, num_tokens, top_k, coeff):
    return aux_loss_cuda(probs, tpe, num_tokens, top_k, coeff), (probs, tpe, num_tokens)


def _aux_loss_vjp_bwd(top_k, coeff, res, g):
    probs, tpe, num_tokens = res
    if jnp.ndim(g) != 0:
        raise ValueError(f"aux-loss cotangent must be rank 0, got shape {jnp.shape(g)}")
    f, scale = _aux_consts(probs, tpe, num_tokens, top_k, coeff)
    dp = _aux_bwd_batched(g.astype(jnp.float32), probs, f, scale)
    return dp, zero_cotangent(tpe), zero_cotangent(num_tokens)


aux_loss_cuda.defvjp(_aux_loss_vjp_fwd, _aux_loss_vjp_bwd)


def aux_loss(probs,
             tokens_per_expert,
             *,
             top_k: int,
             coeff: float,
             num_tokens=None,
             backend: str = "auto"):
    """Switch load-balancing loss (float32 scalar, coefficient applied). See the module doc.

    probs: [T, E] float; tokens_per_expert: [E] (int or float); num_tokens: optional rank-0
    count T (default: T = rows of probs). Gradient flows to probs only.
    backend: 'auto' | 'xla' | 'cuda'; 'cuda' runs the fused kernels (aux_loss_cuda, whose
    sharding rule keeps the cotangent rank 0 and sums the shards' losses).
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [T, E], got shape {probs.shape}")
    if tokens_per_expert.shape != (probs.shape[1], ):
        raise ValueError(
            f"tokens_per_expert must be [E={probs.shape[1]}], got {tokens_per_expert.shape}")
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if num_tokens is None:
        num_tokens = probs.shape[0]
    num_tokens = jnp.asarray(num_tokens)
    if num_tokens.ndim != 0:
        raise ValueError(f"num_tokens must be a scalar, got shape {num_tokens.shape}")
    if _backend.op_backend(backend, "aux_loss") == "cuda":
        if probs.dtype in (jnp.float32, jnp.bfloat16):
            return aux_loss_cuda(probs, tokens_per_expert, num_tokens, int(top_k), float(coeff))
        _backend.warn_fallback("aux_loss", f"probs dtype {probs.dtype} (float32 / bfloat16 only)")
    return _aux_loss(probs, tokens_per_expert, num_tokens, int(top_k), float(coeff))
