"""FP8 expert weights made once and reused: the quantized companion of a master weight.

Transformer Engine casts its master weights to FP8 once per optimizer step and reuses the copy
for every micro-batch; this module is that for MoEConfig.fp8='blockwise' (moe_praxis.ops.fp8).

    Fp8Weight(q [E, K, N] e4m3, s [E, K/128, N/128] float32, qt [E, N, K] e4m3 or None)

is fp8_quant's L2 layout of a weight w [E, K, N]: the forward's B (qt; the CUDA path reads it,
the reference q), the dgrad's B (q, with s transposed) and ONE set of 128x128 block scales for
both (a 128x128 block of w^T is the transpose of a block of w, with the same amax, so its scale
and values are bitwise the same: DeepSeek-V3's shared W / W^T scales). `quantize` makes all
of them in one pass over w (fp8_quant.quantize_weight: one kernel on the GPU).

The GEMMs here take the master weight AND its companion: the forward reads only the companion,
the backward's dgrad the companion, and the weight gradient goes to the master (a custom_vjp in
which the companion gets no cotangent). Each is bitwise the GEMM of ops.fp8 that quantizes
the master inside, because both run the same quantizer on the same values.

Under FSDP (`gathered_prequantized`) each device holds its shard of the master and of the
companion (quantized on the shard: a 128x128 block never straddles a shard boundary,
fp8.check_shard_blocks); the forward all-gathers the e4m3 values and float32 scales, the
backward reduce-scatters the weight gradient, as ops.fp8.recipe.gathered_fp8_grouped_gemm does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from moe_praxis.ops.fp8 import recipe as fp8
from moe_praxis.ops.fp8.quant import E4M3, quantize_weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array  # [E, K, N] e4m3: the dgrad's B (the reference forward's too)
    s: jax.Array  # [E, K/128, N/128] float32: the block scales of q and qt alike
    qt: Optional[jax.Array] = None  # [E, N, K] e4m3: the CUDA forward's B (None: made from q)


def quantize(w, *, transposed: bool = True, backend: str = "auto") -> Fp8Weight:
    """w [E, K, N] (K, N multiples of 128) -> its Fp8Weight in one pass over w; transposed=False
    leaves qt out (the reference path and an FP8 gather do not read it)."""
    q, qt, s = quantize_weight(w, backend=backend)
    return Fp8Weight(q=q, s=s, qt=qt if transposed else None)


def check_companion(w_shape, fw: Fp8Weight, what: str) -> None:
    """fw must be the L2 layout of a weight of shape w_shape (ValueError naming what)."""
    e, k, n = w_shape
    want = {"q": (e, k, n), "s": (e, k // fp8.BLOCK, n // fp8.BLOCK), "qt": (e, n, k)}
    for field, shape in want.items():
        a = getattr(fw, field)
        if a is None:
            continue
        dtype = jnp.float32 if field == "s" else E4M3
        if tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"the FP8 weight of {what}: {field} is {a.dtype.name}"
                             f"{list(a.shape)}; a weight of shape {tuple(w_shape)} needs "
                             f"{jnp.dtype(dtype).name}{list(shape)} (quantize_expert_weights "
                             "makes it)")


def prequantized_fp8_grouped_gemm(lhs, rhs, fw: Fp8Weight, group_sizes, *, backend="auto"):
    """fp8.fp8_grouped_gemm(lhs [R, K], rhs [E, K, N], group_sizes [E]) with rhs's FP8 form
    given (fw = quantize(rhs)): bitwise the same output and gradients (for lhs and rhs);
    fw gets no gradient."""
    return _pre(lhs, rhs, jax.lax.stop_gradient(fw), group_sizes.astype(jnp.int32),
                fp8.resolve(backend))


def prequantized_path(lhs, rhs, fw: Fp8Weight, group_sizes, path: str):
    """prequantized_fp8_grouped_gemm on the given path, 'xla' or 'cuda', unresolved (tests)."""
    if path not in ("xla", "cuda"):
        raise ValueError(f"prequantized_path: path={path!r} is invalid; valid: 'xla', 'cuda'")
    return _pre(lhs, rhs, jax.lax.stop_gradient(fw), group_sizes.astype(jnp.int32), path)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, ))
def _pre(lhs, rhs, fw, group_sizes, impl):
    return fp8._fwd_math(lhs, fw.q, fw.s, group_sizes, impl, fw.qt)


def _pre_fwd(lhs, rhs, fw, group_sizes, impl):
    # rhs is not read: a zero-size array carries its dtype to the weight gradient
    return _pre(lhs, rhs, fw, group_sizes,
                impl), (lhs, fw.q, fw.s, group_sizes, jnp.zeros((0, ), rhs.dtype))


def _pre_bwd(impl, res, dy):
    dx, dw, _ = fp8._fp8_bwd(impl, res, dy)
    return dx, dw, None, None


_pre.defvjp(_pre_fwd, _pre_bwd)


def gathered_prequantized(lhs,
                          rhs_shard,
                          fw_shard: Fp8Weight,
                          group_sizes,
                          axis_name,
                          gather_dim: int,
                          *,
                          backend: str = "auto"):
    """fp8.gathered_fp8_grouped_gemm with the shard's FP8 form given (inside shard_map):
    fw_shard's e4m3 values and scales are all-gathered over axis_name along gather_dim (qt is
    not read: the gathered q is transposed); the weight gradient is reduce-scattered to
    rhs_shard. Bitwise the same as quantizing rhs_shard here."""
    return _gpre(lhs, rhs_shard,
                 jax.lax.stop_gradient(fw_shard.q), jax.lax.stop_gradient(fw_shard.s),
                 group_sizes.astype(jnp.int32), axis_name, gather_dim, fp8.resolve(backend))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gpre(lhs, rhs_shard, q, s, group_sizes, axis_name, gather_dim, impl):
    return _gpre_fwd(lhs, rhs_shard, q, s, group_sizes, axis_name, gather_dim, impl)[0]


def _gpre_fwd(lhs, rhs_shard, q, s, group_sizes, axis_name, gather_dim, impl):
    fp8.check_shard_blocks(q.shape, gather_dim, "the expert weight")
    wq = jax.lax.all_gather(q, axis_name, axis=gather_dim, tiled=True)
    ws = jax.lax.all_gather(s, axis_name, axis=gather_dim, tiled=True)
    out = fp8._fwd_math(lhs, wq, ws, group_sizes, impl)
    return out, (lhs, wq, ws, group_sizes, jnp.zeros((0, ), rhs_shard.dtype))


def _gpre_bwd(axis_name, gather_dim, impl, res, dy):
    dx, dw, _ = fp8._gathered_bwd(axis_name, gather_dim, impl, res, dy)
    return dx, dw, None, None, None


_gpre.defvjp(_gpre_fwd, _gpre_bwd)


def all_gather(fw: Fp8Weight, axis_name, gather_dim: int) -> Fp8Weight:
    """fw's shards all-gathered over axis_name (inside shard_map) in their own dtypes (e4m3
    values, float32 scales): the form of the weight gathered along gather_dim of [E, K, N]
    (qt [E, N, K] along the matching dim). No gradient flows through it."""
    fp8.check_shard_blocks(fw.q.shape, gather_dim, "the expert weight")
    fw = jax.lax.stop_gradient(fw)
    dim_t = (0, 2, 1)[gather_dim]

    def gather(a, dim):
        return jax.lax.all_gather(a, axis_name, axis=dim, tiled=True)

    qt = None if fw.qt is None else gather(fw.qt, dim_t)
    return Fp8Weight(q=gather(fw.q, gather_dim), s=gather(fw.s, gather_dim), qt=qt)
