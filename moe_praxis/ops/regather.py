"""Grouped GEMMs over permuted rows whose backward gathers the rows again (MoEConfig.regather_rows).

    outs[i] = grouped_gemm(permute(x, row_map), ws[i], group_sizes)        i = 0 .. n-1

x: [T, M]; row_map: [R] int (the token of each expert-sorted row, R = T * k; out of range:
a zero row, as in ops.permute); ws: n weights [E, M, N_i] (the gate and up projections: n = 2);
group_sizes: [E] -> outs: n arrays [R, N_i] in x.dtype.

Autodiff of permute, then grouped_gemm keeps the rows [R, M] from the forward until the weight
gradients read them. This op keeps x [T, M] instead (k times smaller; the router's backward
holds it anyway) and permutes again in the backward, which runs in this order (optimization
barriers keep XLA from moving a step earlier):

    rows = permute(x, row_map)                   once the output gradients exist
    dws[i] = wgrad(rows, douts[i])               for every i; the rows die here
    dx = unpermute(dgrad(douts[0], ws[0])) + unpermute(dgrad(douts[1], ws[1])) + ...
                                                 one dgrad at a time, each unpermuted before
                                                 the next runs

So the backward holds one [R, M] array at a time where autodiff of the composition holds the
rows from the forward beside the dgrads' outputs (two of them with ops.permute_pair, which sums
both in one unpermute). The price: one permute more, and one unpermute per weight instead of one
of all (their [T, M] sums added in float32). Every GEMM is ops.grouped_gemm's (its kernels, its
rule, its reference), every permute ops.permute's, on the backend given.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops.grouped_gemm import (dgrad_impl, fwd_impl, grouped_gemm_reference, resolve_impl,
                                         wgrad_impl)
from moe_praxis.ops.permute import permute, permute_reference, unpermute
from moe_praxis.ops.vma import vary_together, zero_cotangent


def regathered_gemms_reference(x, row_map, ws, group_sizes):
    """Autodiff's composition: grouped_gemm_reference(permute_reference(x, row_map), w) per w."""
    rows = permute_reference(x, row_map)
    return tuple(grouped_gemm_reference(rows, w, group_sizes).astype(x.dtype) for w in ws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, ))
def _regathered(x, row_map, index, ws, group_sizes, static):
    backend, impls = static
    rows = permute(x, row_map, backend=backend, index=index)
    return tuple(fwd_impl(rows, w, group_sizes, impl) for w, impl in zip(ws, impls))


def _fwd(x, row_map, index, ws, group_sizes, static):
    return _regathered(x, row_map, index, ws, group_sizes,
                       static), (x, row_map, index, ws, group_sizes)


def regathered_backward(x, row_map, index, ws, douts, group_sizes, impls, backend):
    """The backward of the projections outs[i] = permute(x, row_map) @ ws[i] (module doc), in
    its order: (dx [T, M] in x.dtype, dws). douts: the outputs' gradients [R, N_i]; impls:
    ops.grouped_gemm.resolve_impl's per weight; backend: the permute's. Shared with the fused
    gate/up op (ops.gate_up_swiglu_regathered: one weight, d h its SwiGLU's backward)."""
    douts = tuple(d.astype(x.dtype) for d in douts)
    # the rows again, once the output gradients exist (not at the start of the backward)
    x, douts = jax.lax.optimization_barrier((x, douts))
    rows = permute(x, row_map, backend=backend, index=index)
    dws = tuple(
        wgrad_impl(rows, d, group_sizes, impl).astype(w.dtype)
        for d, w, impl in zip(douts, ws, impls))
    # the dgrads after every wgrad (the rows dead by then), one [R, M] output at a time
    douts, dws = jax.lax.optimization_barrier((douts, dws))
    dx = None
    for d, w, impl in zip(douts, ws, impls):
        if dx is not None:
            dx, d = jax.lax.optimization_barrier((dx, d))
        part = unpermute(dgrad_impl(d, w, group_sizes, impl),
                         row_map,
                         x.shape[0],
                         backend=backend,
                         index=index).astype(jnp.float32)
        dx = part if dx is None else dx + part
    return dx.astype(x.dtype), dws


def _bwd(static, res, douts):
    backend, impls = static
    x, row_map, index, ws, group_sizes = res
    dx, dws = regathered_backward(x, row_map, index, ws, douts, group_sizes, impls, backend)
    return (dx, zero_cotangent(row_map), None if index is None else zero_cotangent(index), dws,
            zero_cotangent(group_sizes))


_regathered.defvjp(_fwd, _bwd)


def regathered_gemms(x, row_map, ws, group_sizes, *, backend: str = "auto", index=None):
    """(grouped_gemm(permute(x, row_map), w, group_sizes) for w in ws) (module doc): x [T, M];
    row_map [R] int; ws: a tuple of [E, M, N_i] weights (cast to x.dtype by the caller);
    group_sizes [E] int; index: ops.permute_index(row_map, T) or None. Differentiable in x and
    ws; the backward permutes x again instead of keeping the rows."""
    ws = tuple(ws)
    if x.ndim != 2 or row_map.ndim != 1:
        raise ValueError(f"regathered_gemms needs x [T, M] and row_map [R]; got {x.shape}, "
                         f"{row_map.shape}")
    for w in ws:
        if w.ndim != 3 or w.shape[1] != x.shape[1] or w.shape[0] != group_sizes.shape[0]:
            raise ValueError(f"regathered_gemms: weight shape {w.shape} does not match x "
                             f"{x.shape} and group_sizes {group_sizes.shape} ([E, M, N] with "
                             f"E = {group_sizes.shape[0]}, M = {x.shape[1]})")
    rows = jax.ShapeDtypeStruct((row_map.shape[0], x.shape[1]), x.dtype)
    impls = tuple(resolve_impl(backend, rows, w) for w in ws)
    x, *ws = vary_together(x, *ws)
    return _regathered(x, row_map.astype(jnp.int32), index, tuple(ws),
                       group_sizes.astype(jnp.int32), (backend, impls))
