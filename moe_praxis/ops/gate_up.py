"""Fused gate/up projection with SwiGLU (MoEConfig.fuse_gate_up): one grouped GEMM.

    h   = grouped_gemm(lhs, w_gate_up, group_sizes)          [M, 2H]
    act = act_fn(h[:, 0::2]) * h[:, 1::2] (* row_weights)     [M, H]

w_gate_up: [E, K, 2H], the two projections' columns interleaved: column 2j is gate unit j,
column 2j + 1 is up unit j (`interleave_gate_up`, `split_gate_up`). Interleaved pairs keep a
unit's gate and up columns in one output tile and in one thread of the CUDA kernel's epilogue,
and keep them together under tensor parallelism (a tp shard of the 2H columns holds whole
units, the same units as its shard of wo).

Backends ('auto' | 'xla' | 'cuda'):
  xla:  grouped_gemm_reference (jax.lax.ragged_dot) then swiglu_reference.
  cuda: kernels/grouped_gemm_swiglu.cu: the CUTLASS sm_90a grouped GEMM of ops.grouped_gemm
        with an epilogue that writes gate, up (de-interleaved, bf16: the backward's residuals)
        and act (silu of the bf16 gate times the bf16 up, times the row weight, as the SwiGLU
        kernel computes it). Needs what ops.grouped_gemm's CUDA path needs, act='silu' and
        H % 8 == 0; other problems run the xla path (with a warning naming the reason).
Backward (custom_vjp, every backend): d h from the SwiGLU backward, written interleaved
(kernels/swiglu.cu, moe_swiglu_bwd_interleaved, on 'cuda'), then ONE dgrad and ONE wgrad
grouped GEMM against w_gate_up (ops.grouped_gemm's kernels and rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops import grouped_gemm as gg
from moe_praxis.ops._library import platform_call
from moe_praxis.ops.permute import permute
from moe_praxis.ops.regather import regathered_backward, regathered_gemms
from moe_praxis.ops.swiglu import (named_gate_up, no_weights, swiglu, swiglu_bwd_ffi,
                                   swiglu_reference)
from moe_praxis.ops.vma import vary_together, zero_cotangent

# Tiles (ops.grouped_gemm.TILE_CONFIGS indices) kernels/grouped_gemm_swiglu.cu is built for:
# pingpong_128x128, coop_128x256 with 2x1 and with 1x1 clusters, the adaptive pair
# coop_128x256 / pingpong_64x256 with 2x1 and with 1x1 clusters, and pingpong_128x192 with 1x1
# and 2x1 clusters.
_FUSED_NAMES = ("pingpong_128x128_c2x1", "coop_128x256_c2x1", "adaptive_128x256_64x256",
                "coop_128x256_c1x1", "adaptive_128x256_64x256_c1x1", "pingpong_128x192_c1x1",
                "pingpong_128x192_c2x1")
FUSED_TILES = tuple(gg.TILE_CONFIGS.index(t) for t in _FUSED_NAMES)
# The fused tile that stands in for each tile the fused kernel is not built for: the 64-row
# 1x1 tile -> the 1x1 pair, other adaptive or 64-row tiles -> the 2x1 pair, the rest ->
# coop_128x256_c2x1. (coop_128x256_c1x1, the forward rule's tile for groups of 257-2048 rows,
# is built too: docs/grouped_gemm.md, "Fused gate/up".)
_STANDIN_NAMES = {
    "coop_256x128_c2x1": "coop_128x256_c2x1",
    "pingpong_64x256_c2x1": "adaptive_128x256_64x256",
    "coop_128x256_c1x2": "coop_128x256_c2x1",
    "pingpong_64x256_c1x2": "adaptive_128x256_64x256",
    "adaptive_128x256_64x256_c1x2": "adaptive_128x256_64x256",
    "pingpong_64x256_c1x1": "adaptive_128x256_64x256_c1x1",
}
FUSED_STANDIN = {
    gg.TILE_CONFIGS.index(a): gg.TILE_CONFIGS.index(b)
    for a, b in _STANDIN_NAMES.items()
}
TARGET = "moe_grouped_gemm_swiglu_fwd"


def interleave_gate_up(wi_gate, wi_up):
    """[..., H] and [..., H] -> [..., 2H] with column 2j = wi_gate[..., j], 2j + 1 = wi_up[..., j]."""
    if wi_gate.shape != wi_up.shape:
        raise ValueError(f"wi_gate and wi_up must have one shape, got {wi_gate.shape}, "
                         f"{wi_up.shape}")
    return jnp.stack([wi_gate, wi_up],
                     axis=-1).reshape(wi_gate.shape[:-1] + (2 * wi_gate.shape[-1], ))


def split_gate_up(w_gate_up):
    """Inverse of interleave_gate_up: [..., 2H] -> (gate [..., H], up [..., H])."""
    return w_gate_up[..., 0::2], w_gate_up[..., 1::2]


def choose_fused_config(m: int, k: int, n: int, num_groups: int) -> str:
    """Kernel configuration of the fused forward (n = 2H): ops.grouped_gemm's forward rule
    (or the environment variable MOE_PRAXIS_GG_TILE), its tile replaced by FUSED_STANDIN's
    when the fused kernel is not built for it (the rule's own tiles all are; a tile forced by
    MOE_PRAXIS_GG_TILE may not be: docs/grouped_gemm.md, "Fused gate/up")."""
    tile, raster, swizzle, split_rows = gg.parse_config(gg.choose_config(
        "fwd", m, k, n, num_groups))
    tile = FUSED_STANDIN.get(tile, tile)
    return gg.config_name(tile, raster, swizzle, split_rows)


def gate_up_swiglu_reference(lhs, w_gate_up, group_sizes, row_weights=None, *, act="silu"):
    """(gate [M, H], up [M, H], act [M, H]) in lhs.dtype, from ragged_dot and
    swiglu_reference."""
    h = gg.grouped_gemm_reference(lhs, w_gate_up, group_sizes).astype(lhs.dtype)
    gate, up = split_gate_up(h)
    return gate, up, swiglu_reference(gate, up, row_weights, act=act)


def cuda_fwd(lhs, w_gate_up, group_sizes, w, has_weight: bool, config: str):
    """The fused forward kernel with `config` (tiles in FUSED_TILES): (gate, up, act), each
    [M, H] in lhs.dtype; w: [M] float32 row weights, or no_weights() with has_weight=False.
    No fallback, no vjp."""
    half = jax.ShapeDtypeStruct((lhs.shape[0], w_gate_up.shape[2] // 2), lhs.dtype)
    gate, up, act, _ = gg.call_kernel(TARGET, (half, half, half),
                                      lhs,
                                      w_gate_up,
                                      group_sizes,
                                      w,
                                      num_groups=group_sizes.shape[0],
                                      config=config,
                                      tiles=FUSED_TILES,
                                      has_weight=has_weight)
    return gate, up, act


def _swiglu_bwd_ref(gate, up, w, dact, has_weight, act):
    _, vjp = jax.vjp(lambda g, u, ww: swiglu_reference(g, u, ww if has_weight else None, act=act),
                     gate, up, w)
    dg, du, dw = vjp(dact)
    return interleave_gate_up(dg, du), dw


def _fwd_impl(lhs, w_gate_up, group_sizes, w, impl):
    backend, config, has_weight, act = impl
    ref = functools.partial(_fwd_ref, has_weight=has_weight, act=act)
    if backend == "xla" or gg.is_empty(lhs.shape[0], lhs.shape[1], w_gate_up.shape[2],
                                       w_gate_up.shape[0]):
        return ref(lhs, w_gate_up, group_sizes, w)
    cfg = config or choose_fused_config(lhs.shape[0], lhs.shape[1], w_gate_up.shape[2],
                                        group_sizes.shape[0])
    return platform_call(lambda a, b, g, ww: cuda_fwd(a, b, g, ww, has_weight, cfg), ref, lhs,
                         w_gate_up, group_sizes, w)


def _fwd_ref(lhs, w_gate_up, group_sizes, w, *, has_weight, act):
    return gate_up_swiglu_reference(lhs, w_gate_up, group_sizes, w if has_weight else None, act=act)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, ))
def _gate_up_swiglu(lhs, w_gate_up, group_sizes, w, impl):
    return _fwd_impl(lhs, w_gate_up, group_sizes, w, impl)[2]


def _vjp_fwd(lhs, w_gate_up, group_sizes, w, impl):
    gate, up, act = _fwd_impl(lhs, w_gate_up, group_sizes, w, impl)
    gate, up = named_gate_up(gate, up)
    return act, (lhs, w_gate_up, group_sizes, w, gate, up)


def _swiglu_bwd(impl, gate, up, w, dact):
    """(d h [M, 2H] interleaved, d row weights) of the fused forward's SwiGLU."""
    backend, _, has_weight, act = impl
    dact = dact.astype(gate.dtype)
    ref = functools.partial(_swiglu_bwd_ref, has_weight=has_weight, act=act)
    if backend == "xla":
        dh, dw = ref(gate, up, w, dact)
    else:
        dh, dw = platform_call(
            functools.partial(swiglu_bwd_ffi, has_weight=has_weight, interleaved=True), ref, gate,
            up, w, dact)
    return dh, (dw.astype(w.dtype) if has_weight else jnp.zeros_like(w))


def _gemm_impl(backend):
    # dgrad / wgrad: ops.grouped_gemm's Hopper kernels (the fused forward runs beside them only)
    return (backend, None, "sm90" if backend == "cuda" else None)


def _vjp_bwd(impl, res, dact):
    lhs, w_gate_up, group_sizes, w, gate, up = res
    dh, dw = _swiglu_bwd(impl, gate, up, w, dact)
    gimpl = _gemm_impl(impl[0])
    dlhs = gg.dgrad_impl(dh, w_gate_up, group_sizes, gimpl)
    dw_gate_up = gg.wgrad_impl(lhs, dh, group_sizes, gimpl).astype(w_gate_up.dtype)
    return (dlhs, dw_gate_up, zero_cotangent(group_sizes), dw)


_gate_up_swiglu.defvjp(_vjp_fwd, _vjp_bwd)


def _unsupported(lhs, w_gate_up, act: str) -> str | None:
    why = gg.cuda_unsupported_reason(lhs, w_gate_up)
    if why is not None:
        return why
    if act != "silu":
        return f"act={act!r} (the fused epilogue computes silu only)"
    if (w_gate_up.shape[2] // 2) % 8:
        return f"the fused gate/up kernel needs H % 8 == 0, got H={w_gate_up.shape[2] // 2}"
    return None


def _fused_backend(backend: str, lhs, w_gate_up, act: str) -> str:
    """'unfused' (the fused kernel is Hopper-only, but the grouped GEMM has a kernel here),
    'cuda' (the fused kernel) or 'xla' (with a warning naming why where the fused kernel cannot
    take the problem)."""
    if (backend != "xla" and _backend.fused_gate_up_reason()
            and _backend.cuda_status("grouped_gemm")[0]
            and gg.resolve(backend, lhs, w_gate_up) == "cuda"):
        return "unfused"
    resolved = gg.resolve(backend, lhs, w_gate_up, op="gate_up_swiglu")
    if resolved == "cuda":
        why = _unsupported(lhs, w_gate_up, act)
        if why is not None:
            _backend.warn_fallback("gate_up_swiglu", why)
            resolved = "xla"
    return resolved


def _unfused(project, row_weights, act, config=None):
    """project() (the grouped GEMM against w_gate_up on 'cuda', h [R, 2H]), then the SwiGLU op
    on its halves on 'cuda': where the fused kernel cannot run beside the grouped GEMM kernel
    (backend.fused_gate_up_reason). A forced fused configuration has no kernel to go to: an
    error."""
    why = _backend.fused_gate_up_reason()
    if config is not None:
        raise ValueError(f"gate_up_swiglu config={config!r} configures the fused kernel, which "
                         f"does not run here: {why}")
    _backend.warn_once(f"moe_praxis: gate_up_swiglu runs unfused: {why}")
    return swiglu(*split_gate_up(project()), row_weights, act=act, backend="cuda")


def _check_operands(w_gate_up, group_sizes, row_weights, num_rows: int, rows: str = "M"):
    """w_gate_up [E, K, 2H], group_sizes [E] and row_weights [num_rows] (or None), as both
    gate_up_swiglu and gate_up_swiglu_regathered take them; `rows` names the row count."""
    if w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up's last dimension must be even (2H), got {w_gate_up.shape}")
    if group_sizes.shape != (w_gate_up.shape[0], ):
        raise ValueError(f"group_sizes must be [E={w_gate_up.shape[0]}], got {group_sizes.shape}")
    if row_weights is not None and row_weights.shape != (num_rows, ):
        raise ValueError(f"row_weights must be [{rows}={num_rows}], got {row_weights.shape}")


def gate_up_swiglu(lhs,
                   w_gate_up,
                   group_sizes,
                   row_weights=None,
                   *,
                   act: str = "silu",
                   backend: str = "auto",
                   config: str | None = None):
    """act_fn(lhs @ gate) * (lhs @ up) (* row_weights[:, None]) per group -> [M, H] in lhs.dtype.

    lhs [M, K]; w_gate_up [E, K, 2H] (interleaved, module doc); group_sizes [E] integer (rows
    past their sum come out zero); row_weights: optional [M] routing weights (gradient returned
    in their dtype). config: force the fused CUDA forward's configuration (tiles in
    FUSED_TILES); default `choose_fused_config`. Differentiable in lhs, w_gate_up, row_weights.
    """
    if lhs.ndim != 2 or w_gate_up.ndim != 3 or lhs.shape[1] != w_gate_up.shape[1]:
        raise ValueError(f"gate_up_swiglu needs lhs [M,K], w_gate_up [E,K,2H]; got {lhs.shape}, "
                         f"{w_gate_up.shape}")
    _check_operands(w_gate_up, group_sizes, row_weights, lhs.shape[0])
    if config is not None:
        config = gg.config_name(*gg.parse_config(config))
    resolved = _fused_backend(backend, lhs, w_gate_up, act)
    if resolved == "unfused":
        return _unfused(lambda: gg.grouped_gemm(lhs, w_gate_up, group_sizes, backend="cuda"),
                        row_weights, act, config)
    has_weight = row_weights is not None
    if has_weight:
        # one shard_map type for the rows and their weights (ops.vma.vary_together): the
        # weights' gradient comes back in their own type
        lhs, w = vary_together(lhs, row_weights.astype(jnp.float32))
    else:
        w = no_weights()
    out = _gate_up_swiglu(lhs, w_gate_up, group_sizes.astype(jnp.int32), w,
                          (resolved, config, has_weight, act))
    return out


# ------------------------------------------ the rows gathered again (MoEConfig.regather_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _regathered(x, row_map, index, w_gate_up, group_sizes, w, impl, permute_backend):
    rows = permute(x, row_map, backend=permute_backend, index=index)
    return _fwd_impl(rows, w_gate_up, group_sizes, w, impl)[2]


def _regathered_fwd(x, row_map, index, w_gate_up, group_sizes, w, impl, permute_backend):
    rows = permute(x, row_map, backend=permute_backend, index=index)
    gate, up, act = _fwd_impl(rows, w_gate_up, group_sizes, w, impl)
    gate, up = named_gate_up(gate, up)
    return act, (x, row_map, index, w_gate_up, group_sizes, w, gate, up)


def _regathered_bwd(impl, permute_backend, res, dact):
    x, row_map, index, w_gate_up, group_sizes, w, gate, up = res
    dh, dw = _swiglu_bwd(impl, gate, up, w, dact)
    # the rows again once d h exists, the wgrad, then (the rows dead) the dgrad and its unpermute
    dx, (dw_gate_up, ) = regathered_backward(x, row_map, index, (w_gate_up, ), (dh, ), group_sizes,
                                             (_gemm_impl(impl[0]), ), permute_backend)
    return (dx, zero_cotangent(row_map), None if index is None else zero_cotangent(index),
            dw_gate_up, zero_cotangent(group_sizes), dw)


_regathered.defvjp(_regathered_fwd, _regathered_bwd)


def gate_up_swiglu_regathered(x,
                              row_map,
                              w_gate_up,
                              group_sizes,
                              row_weights=None,
                              *,
                              act: str = "silu",
                              backend: str = "auto",
                              index=None):
    """gate_up_swiglu(permute(x, row_map), w_gate_up, group_sizes, row_weights) -> [R, H], whose
    backward keeps x [T, M] instead of the rows [R, M] and permutes x again for the weight
    gradient, before the one dgrad (as ops.regathered_gemms does for separate projections).

    x: [T, M]; row_map: [R] int (out of range: a zero row); index: ops.permute_index(row_map,
    T) or None; the rest as gate_up_swiglu's. Differentiable in x, w_gate_up, row_weights."""
    if x.ndim != 2 or row_map.ndim != 1 or w_gate_up.ndim != 3 or x.shape[1] != w_gate_up.shape[1]:
        raise ValueError(f"gate_up_swiglu_regathered needs x [T, M], row_map [R], w_gate_up "
                         f"[E, M, 2H]; got {x.shape}, {row_map.shape}, {w_gate_up.shape}")
    _check_operands(w_gate_up, group_sizes, row_weights, row_map.shape[0], "R")
    row_map = row_map.astype(jnp.int32)
    rows = jax.ShapeDtypeStruct((row_map.shape[0], x.shape[1]), x.dtype)
    resolved = _fused_backend(backend, rows, w_gate_up, act)
    if resolved == "unfused":  # the projection (regathered in its backward), then the SwiGLU
        return _unfused(
            lambda: regathered_gemms(
                x, row_map, (w_gate_up, ), group_sizes, backend="cuda", index=index)[0],
            row_weights, act)
    has_weight = row_weights is not None
    if has_weight:
        x, w_gate_up, w = vary_together(x, w_gate_up, row_weights.astype(jnp.float32))
    else:
        (x, w_gate_up), w = vary_together(x, w_gate_up), no_weights()
    return _regathered(x, row_map, index, w_gate_up, group_sizes.astype(jnp.int32), w,
                       (resolved, None, has_weight, act), backend)
