"""Router op: float32 logits -> dense probabilities, top-k expert ids and combine weights.

All math is float32. Letters: T tokens, E experts, k top_k. Static arguments (`RouterArgs`):
the score function and pre_softmax pick a row of moe_praxis.ops.routing_table (its math, its
kernel mode; the choices and the models that use them: docs/config.md#router-math), then
  ids = topk(selection scores + bias), w = the row's weights (w /= sum(w) if norm_topk, where
  the row takes it), w *= scaling.
The expert bias steers selection only; weights always come from unbiased scores.
Group-limited top-k masks all but the best `group_topk` of `num_groups` groups before the
top-k; a group's score is the sum of its top `top_k // group_topk` selection scores. Ties go to
the lower expert index (jax.lax.top_k's order). probs is the row's load-balancing loss input.

CUDA side (kernels/router.cu): `router_cuda`, a custom_vjp whose forward and backward are each
a `platform_call` of the fused kernel and the reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.routing_table import ROUTER_PRECISIONS, resolve
from moe_praxis.ops.split_dot import bf16x3_dot

ROUTER_MAX_EXPERTS, ROUTER_MAX_TOP_K, ROUTER_MAX_GROUPS = 512, 8, 32


class RouterArgs(NamedTuple):
    """The router's static arguments (hashable: the custom_vjp's non-differentiable input)."""
    score_func: str = "softmax"
    pre_softmax: bool = True
    top_k: int = 2
    norm_topk: bool = True
    num_groups: int = 1
    group_topk: int = 1
    scaling: float = 1.0


def _group_limit(sel, args: RouterArgs):
    """Masks (to -inf) the experts outside each token's best `group_topk` groups."""
    t, e = sel.shape
    g = args.num_groups
    per_group = sel.reshape(t, g, e // g)
    group_scores = jax.lax.top_k(per_group, args.top_k // args.group_topk)[0].sum(-1)
    _, keep = jax.lax.top_k(group_scores, args.group_topk)  # [T, group_topk]
    keep_mask = jnp.sum(jax.nn.one_hot(keep, g, dtype=jnp.int32), axis=1) > 0  # [T, G]
    keep_mask = jnp.repeat(keep_mask, e // g, axis=1)
    return jnp.where(keep_mask, sel, -jnp.inf)


def _reference(args: RouterArgs, logits, bias):
    """float32 routing math; the score function's parts come from its routing_table row."""
    choice = resolve(args.score_func, args.pre_softmax)
    logits = logits.astype(jnp.float32)
    dense = choice.scores(logits)
    probs = choice.probs(dense)
    sel = choice.selects(logits, dense)
    sel = sel if bias is None else sel + bias
    if args.num_groups > 1:
        sel = _group_limit(sel, args)
    _, ids = jax.lax.top_k(sel, args.top_k)
    weights = choice.weights(logits, dense, ids, args.norm_topk)
    weights = weights * args.scaling
    return probs, ids.astype(jnp.int32), weights


def router_reference(logits, expert_bias: Optional[jax.Array] = None, **static):
    """Pure-JAX router (the CPU path and test oracle): logits [T, E] -> (probs [T, E] f32,
    expert_ids [T, k] int32, weights [T, k] f32). static: the RouterArgs fields."""
    bias = None
    if expert_bias is not None:
        bias = jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    return _reference(RouterArgs(**static), logits, bias)


def router_gemm(x, w_router, *, precision: str = "float32"):
    """The router logits x [T, M] @ w_router [M, E] -> float32 [T, E], in the `precision`:

      'float32': float32 inputs, float32 products and sums (Precision.HIGHEST: CUDA cores on a
                 GPU, not tensor cores).
      'tf32':    inputs rounded to TF32 (8 exponent, 10 mantissa bits; a bf16 x is exact in it),
                 float32 sums, at the platform's default float32 precision (TF32 tensor cores
                 on Ampere and later GPUs; float32 arithmetic on the CPU, same rounded inputs).
      'bf16':    inputs cast to bfloat16, float32 accumulation (bf16 tensor cores on a GPU).
      'bf16x3':  each float32 input split into a bf16 (hi, lo) pair, three bf16 GEMMs (two for
                 a bf16 x) with float32 accumulation, forward and backward (ops.split_dot:
                 XLA's bf16_3x; float32-level logits on bf16 tensor cores).
      'auto':    'bf16x3' where lowered for a CUDA GPU, 'float32' elsewhere (the CPU's
                 logits and gradients are bitwise those of 'float32').

    The GEMM is XLA's on every kernel backend (the fused router kernel takes the logits).
    """
    if precision == "auto":
        return platform_call(bf16x3_dot, functools.partial(router_gemm, precision="float32"), x,
                             w_router)
    if precision == "bf16x3":
        return bf16x3_dot(x, w_router)
    if precision == "float32":
        return jnp.dot(x.astype(jnp.float32),
                       w_router.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    if precision == "tf32":
        x32, w32 = (jax.lax.reduce_precision(a.astype(jnp.float32),
                                             exponent_bits=8,
                                             mantissa_bits=10) for a in (x, w_router))
        return jnp.dot(x32, w32, preferred_element_type=jnp.float32)
    if precision == "bf16":
        return jnp.dot(x.astype(jnp.bfloat16),
                       w_router.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
    raise ValueError(f"router precision {precision!r} is invalid; valid: {ROUTER_PRECISIONS}")


# ------------------------------------------------------------------------------ CUDA side


def router_unsupported(num_experts: int, top_k: int, num_groups: int = 1) -> str:
    """'' if the fused router kernel handles this problem, else why not."""
    if num_experts > ROUTER_MAX_EXPERTS:
        return f"num_experts={num_experts} > {ROUTER_MAX_EXPERTS}"
    if top_k > ROUTER_MAX_TOP_K:
        return f"top_k={top_k} > {ROUTER_MAX_TOP_K}"
    if num_groups > ROUTER_MAX_GROUPS:
        return f"num_expert_groups={num_groups} > {ROUTER_MAX_GROUPS}"
    return ""


def _attrs(args: RouterArgs) -> dict:
    return dict(top_k=args.top_k,
                mode=resolve(args.score_func, args.pre_softmax).kernel_mode,
                norm_topk=bool(args.norm_topk),
                num_groups=args.num_groups,
                group_topk=args.group_topk,
                scaling=float(args.scaling))


def _fwd_ffi(args: RouterArgs, logits, bias):
    t, e = logits.shape
    k = args.top_k
    out = (jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct(
        (t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32))
    return tuple(ffi("moe_router_fwd", out, logits, bias, **_attrs(args)))


def _bwd_ref(args: RouterArgs, logits, bias, ids, dprobs, dweights):
    del ids  # the reference re-selects (same ids: the selection is deterministic)
    _, vjp = jax.vjp(lambda l: (lambda o: (o[0], o[2]))(_reference(args, l, bias)), logits)
    return vjp((dprobs, dweights))[0]


def _bwd_ffi(args: RouterArgs, logits, bias, ids, dprobs, dweights):
    del bias
    return ffi("moe_router_bwd", jax.ShapeDtypeStruct(logits.shape, jnp.float32), logits, ids,
               dprobs, dweights, **_attrs(args))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, ))
def _fused_router(args: RouterArgs, logits, bias):
    return platform_call(functools.partial(_fwd_ffi, args), functools.partial(_reference, args),
                         logits, bias)


def _fused_fwd(args, logits, bias):
    out = _fused_router(args, logits, bias)
    return out, (logits, bias, out[1])


def _fused_bwd(args, res, cts):
    logits, bias, ids = res
    dprobs, _, dweights = cts
    dprobs = jnp.zeros(logits.shape, jnp.float32) if dprobs is None else dprobs
    dlogits = platform_call(functools.partial(_bwd_ffi, args), functools.partial(_bwd_ref, args),
                            logits, bias, ids, dprobs.astype(jnp.float32),
                            dweights.astype(jnp.float32))
    return dlogits, jnp.zeros_like(bias)


_fused_router.defvjp(_fused_fwd, _fused_bwd)


def router_cuda(logits, bias, **static):
    """The fused router kernel (forward and backward; the reference where not lowered for
    CUDA). logits: [T, E] f32, bias: [E] f32 (zeros = none; selection only, no gradient)
    -> (probs, expert_ids, weights) as router_reference computes them."""
    return _fused_router(RouterArgs(**static), logits, bias)


def route(logits, expert_bias: Optional[jax.Array] = None, *, backend: str = "auto", **static):
    """logits [T, E] -> (probs [T, E] f32, expert_ids [T, k] int32, weights [T, k] f32).

    static: the RouterArgs fields (score_func, pre_softmax, top_k, norm_topk, num_groups,
    group_topk, scaling). backend: 'auto' | 'xla' | 'cuda'; 'cuda' runs the fused router kernel
    (forward and backward) where it takes the problem (router_unsupported), else the reference
    with a warning naming the reason.
    """
    args = RouterArgs(**static)
    choice = resolve(args.score_func, args.pre_softmax)
    if _backend.op_backend(backend, "router") == "cuda":
        why = router_unsupported(logits.shape[-1], args.top_k, args.num_groups)
        if not why and choice.kernel_mode is None:
            why = f"score_func={args.score_func!r} has no mode in the fused router kernel"
        if not why:
            logits = logits.astype(jnp.float32)
            bias = (jnp.zeros((logits.shape[-1], ), jnp.float32) if expert_bias is None else
                    jax.lax.stop_gradient(expert_bias.astype(jnp.float32)))
            return _fused_router(args, logits, bias)
        _backend.warn_fallback("router", why)
    return router_reference(logits, expert_bias, **static)
