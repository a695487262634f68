"""float32-level GEMMs on bf16 tensor cores: each float32 operand split into a bf16 pair.

    a = a_hi + a_lo,  a_hi = bf16(a),  a_lo = bf16(a - a_hi)      (16 mantissa bits of a)
    a @ b ~= a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi              (float32 accumulation)

XLA's bf16_3x algorithm written as plain bf16 dots, so it runs on every platform (on the CPU too,
for the tests) and needs no dot-algorithm support: the dropped a_lo @ b_lo term and the lo parts'
own rounding leave a relative error near 2^-16 per product, against 2^-8 for one bf16 GEMM.
A bf16 operand is its own hi part (lo = 0): its lo terms are skipped (2 GEMMs instead of 3).
The split uses reduce_precision, which XLA keeps, not a float32 -> bf16 -> float32 round trip
of converts, which XLA:GPU may fold away (excess precision) and so zero the lo part.

The backward (custom_vjp) splits the same way: dx = g @ w^T and dw = x^T @ g, both bf16x3 with
float32 accumulation, cast to the operands' dtypes. Where a product's output is larger than its
operands (dx: [T, M] from [T, E] and [E, M]) its terms are one GEMM over the stacked contraction
(3E): one float32 [T, M] output, not three (XLA's temporaries of the Qwen3-like step held three
such 128 MiB buffers, and two passes added them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_praxis.ops.vma import vary_together


def _split(a):
    """a -> (hi, lo) bf16, lo None where a is bf16 (exact in hi)."""
    if a.dtype == jnp.bfloat16:
        return a, None
    a = a.astype(jnp.float32)
    hi = jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)
    return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def _dot3(a, b):
    """a [P, Q] @ b [Q, R] -> float32, bf16x3. Where the output is larger than the operands
    (the router's dx: [T, M] from [T, E] and [E, M]) the terms are ONE GEMM over the stacked
    contraction, [a_lo | a_hi | a_hi] @ [b_hi; b_lo; b_hi], with one float32 output instead of
    three and two passes adding them; elsewhere (small outputs, where stacking would copy the
    large operand) separate GEMMs, the small terms summed first."""
    (ah, al), (bh, bl) = _split(a), _split(b)
    dot = lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32)
    small = [(u, v) for u, v in ((al, bh), (ah, bl)) if u is not None and v is not None]
    (p, q), r = a.shape, b.shape[1]
    if small and p * r > p * q + q * r:
        terms = small + [(ah, bh)]
        return dot(jnp.concatenate([u for u, _ in terms], axis=1),
                   jnp.concatenate([v for _, v in terms], axis=0))
    out = dot(ah, bh)
    if small:
        small = [dot(u, v) for u, v in small]
        out = sum(small[1:], small[0]) + out
    return out


def bf16x3_dot(x, w):
    """x [T, M] @ w [M, N] -> float32 [T, N] at float32-level accuracy on bf16 tensor cores.
    Inside shard_map both operands are first cast to vary together (ops.vma.vary_together):
    autodiff of that cast sums w's cotangent over the token axes, as a plain dot's would."""
    return _bf16x3(*vary_together(x, w))


@jax.custom_vjp
def _bf16x3(x, w):
    return _dot3(x, w)


def _fwd(x, w):
    return _dot3(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    g = g.astype(jnp.float32)
    return _dot3(g, w.T).astype(x.dtype), _dot3(x.T, g).astype(w.dtype)


_bf16x3.defvjp(_fwd, _bwd)
