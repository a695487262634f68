"""A grouped GEMM whose forward, dgrad and wgrad each run in FP8 or in bf16 (ops.fp8.rule).

    mixed_grouped_gemm(lhs [R, K], rhs [E, K, N], group_sizes [E], gemms) -> [R, N] in lhs.dtype

`gemms` (an fp8_rule.Fp8Gemms) names the GEMMs that run in blockwise FP8, with the numerics of
ops.fp8 (the kernels where `backend` resolves to cuda, else the pure-JAX emulation); the others
run ops.grouped_gemm on rhs cast to lhs.dtype (the master weight, never its FP8 form). The FP8
form of rhs (fw, an ops.fp8.weights.Fp8Weight made beforehand) is read by the FP8 forward and
dgrad only; without it rhs is quantized here when one of them runs in FP8. lhs_fp8: lhs's L1
operand (q, s_t) written by the op that produced lhs, read by the CUDA FP8 forward. Gradients
reach lhs and rhs (in rhs.dtype); fw and lhs_fp8 get none. With every GEMM in FP8 use
ops.fp8's own ops (they keep one quantization of lhs for several weights).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops.fp8 import recipe as fp8
from moe_praxis.ops.grouped_gemm import dgrad_impl, fwd_impl, wgrad_impl
from moe_praxis.ops.grouped_gemm import resolve as gg_resolve
from moe_praxis.ops.fp8.rule import Fp8Gemms
from moe_praxis.ops.fp8.weights import Fp8Weight


def mixed_grouped_gemm(lhs,
                       rhs,
                       group_sizes,
                       gemms: Fp8Gemms,
                       *,
                       fw: Optional[Fp8Weight] = None,
                       lhs_fp8=None,
                       backend: str = "auto"):
    """Module doc. backend: 'auto' | 'xla' | 'cuda' for the FP8 GEMMs (ops.fp8.recipe.resolve) and the
    bf16 ones (ops.grouped_gemm.resolve) alike."""
    impl = fp8.resolve(backend)
    gs = group_sizes.astype(jnp.int32)
    wq = ws = wqt = None
    if gemms.fwd or gemms.dgrad:
        if fw is None:
            wq, wqt, ws = fp8._quantize_weight(jax.lax.stop_gradient(rhs), impl)
        else:
            wq, ws, wqt = jax.lax.stop_gradient((fw.q, fw.s, fw.qt))
    if not (impl == "cuda" and gemms.fwd):
        lhs_fp8 = None
    elif lhs_fp8 is not None:
        lhs_fp8 = jax.lax.stop_gradient(tuple(lhs_fp8))
    dt = lhs.dtype
    resolved = gg_resolve(backend, lhs, rhs.astype(dt))
    family = _backend.grouped_gemm_kernel(dtype=dt)[0] if resolved == "cuda" else None
    return _mixed(lhs, rhs, wq, ws, wqt, lhs_fp8, gs, gemms, impl, (resolved, None, family))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _mixed(lhs, rhs, wq, ws, wqt, lhs_fp8, group_sizes, gemms, impl, gg_impl):
    return _mixed_fwd(lhs, rhs, wq, ws, wqt, lhs_fp8, group_sizes, gemms, impl, gg_impl)[0]


def _mixed_fwd(lhs, rhs, wq, ws, wqt, lhs_fp8, group_sizes, gemms, impl, gg_impl):
    dt = lhs.dtype
    if not gemms.fwd:
        out = fwd_impl(lhs, rhs.astype(dt), group_sizes, gg_impl)
    elif lhs_fp8 is not None:
        bt = jnp.swapaxes(wq, 1, 2) if wqt is None else wqt
        out = fp8._nt(*lhs_fp8, bt, ws, group_sizes, dt)
    else:
        out = fp8._fwd_math(lhs, wq, ws, group_sizes, impl, wqt)
    # the master weight is kept only for a bf16 dgrad; a zero-size array carries its dtype
    w_res = jnp.zeros((0, ), rhs.dtype) if gemms.dgrad else rhs
    fp8_res = (wq, ws) if gemms.dgrad else None
    return out, (lhs, w_res, fp8_res, group_sizes)


def _mixed_bwd(gemms, impl, gg_impl, res, dy):
    lhs, w_res, fp8_res, group_sizes = res
    dt = lhs.dtype
    if gemms.dgrad:
        dx = fp8._dgrad_math(dy, *fp8_res, group_sizes, dt, impl)
    else:
        dx = dgrad_impl(dy.astype(dt), w_res.astype(dt), group_sizes, gg_impl)
    if gemms.wgrad:
        dw = fp8._wgrad_math(lhs, dy, group_sizes, w_res.dtype, impl)
    else:
        dw = wgrad_impl(lhs, dy.astype(dt), group_sizes, gg_impl).astype(w_res.dtype)
    return dx, dw, None, None, None, None, None


_mixed.defvjp(_mixed_fwd, _mixed_bwd)
