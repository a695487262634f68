"""SwiGLU then the down projection, with dSwiGLU in the down projection's dgrad epilogue.

    act = silu(gate) * up (* w[:, None])                 [M, H]
    out = grouped_gemm(act, wo, group_sizes)             [M, N]

Backward:
    dact  = dout @ wo[e]^T                               (the down projection's dgrad)
    dgate = dact * w * up * silu'(gate),  dup = dact * w * silu(gate)
    dw[r] = sum_h dact[r, h] * silu(gate[r, h]) * up[r, h]
    dwo   = wgrad(act, dout)

`swiglu_down` (gate, up given: MoEConfig.fuse_swiglu_bwd) and `gate_up_swiglu_down` (the fused
gate/up projection in front: fuse_gate_up too) run, where the fused kernel can (`fused_reason`:
backend 'cuda' with the Hopper grouped GEMM, bf16, H % 8 == 0, silu), ONE kernel for the
first three lines: kernels/grouped_gemm_dswiglu.cu, the dgrad grouped GEMM whose epilogue reads
gate and up and writes dgate and dup (or their interleaved [M, 2H] form, the fused gate/up
layout), the activation recomputed (for dwo's wgrad: the forward keeps only gate and up) and dw
(per-tile row sums, summed by a small second kernel: deterministic). No separate SwiGLU
backward runs. Elsewhere both ops are the unfused composition of ops.swiglu / ops.gate_up and
ops.grouped_gemm, whatever the backend (so the xla path is today's).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops import gate_up as _gate_up
from moe_praxis.ops._library import platform_call
from moe_praxis.ops.swiglu import (named_gate_up, no_weights, swiglu, swiglu_cuda, swiglu_reference)
from moe_praxis.ops.vma import vary_together, zero_cotangent

gg = _gate_up.gg  # ops.grouped_gemm, the module (the package's name is the function)
# FFI targets: dgate and dup [M, H] each, or (interleaved) dgate_up [M, 2H]
TARGETS = {False: "moe_grouped_gemm_dswiglu", True: "moe_grouped_gemm_dswiglu_interleaved"}
# kernels/grouped_gemm_dswiglu.cu is built for the fused forward's tiles (ops.gate_up)
FUSED_TILES = _gate_up.FUSED_TILES
# the Hopper grouped GEMM family, as the op's backward calls ops.grouped_gemm's kernels
_GIMPL = ("cuda", None, "sm90")


def tile_width(config: str) -> int:
    """The output tile width (columns) of a configuration's tile; an adaptive pair's two tiles
    share it. dw's per-tile partials are ceil(H / tile_width) per row."""
    name = gg.TILE_CONFIGS[gg.parse_config(config)[0]]
    return int(re.search(r"_(\d+)x(\d+)", name).group(2))


def choose_config(m: int, h: int, n: int, num_groups: int) -> str:
    """Configuration of the fused dgrad: ops.grouped_gemm's dgrad rule for the down projection's
    forward dims (m rows, k = H, n = N; or MOE_PRAXIS_GG_TILE), its tile replaced by
    ops.gate_up.FUSED_STANDIN's where this kernel is not built for it."""
    tile, raster, swizzle, split_rows = gg.parse_config(
        gg.choose_config("dgrad", m, h, n, num_groups))
    return gg.config_name(_gate_up.FUSED_STANDIN.get(tile, tile), raster, swizzle, split_rows)


def partial_bytes(m: int, h: int, config: str, has_weight: bool) -> int:
    """Workspace bytes of dw's per-tile partials (float32 [M, ceil(H / tile width)], rounded up
    to 256; 0 without weights), after the grouped GEMM's own workspace."""
    if not has_weight:
        return 0
    cols = -(-h // tile_width(config))
    return -(-m * cols * 4 // 256) * 256


# ----------------------------------------------------------------- the dgrad + dSwiGLU


def dswiglu_dgrad_reference(dout, wo, group_sizes, gate, up, w, *, has_weight: bool,
                            interleaved: bool):
    """(grads, act, dw): grads = (dgate, dup) [M, H] each, or dgate_up [M, 2H] (interleaved);
    act [M, H] (zero past sum(group_sizes)); dw [M] f32 (w's shape without weights: zeros).
    dact is the dgrad rounded to gate.dtype, as the unfused backward stores it."""
    dact = gg.grouped_gemm_dgrad_reference(dout, wo, group_sizes).astype(gate.dtype)
    act, vjp = jax.vjp(
        lambda g, u, ww: swiglu_reference(g, u, ww
                                          if has_weight else None, act="silu"), gate, up, w)
    dg, du, dw = vjp(dact)
    rows = jnp.arange(gate.shape[0]) < jnp.sum(jnp.maximum(group_sizes, 0))
    act = jnp.where(rows[:, None], act, jnp.zeros_like(act))
    grads = _gate_up.interleave_gate_up(dg, du) if interleaved else (dg, du)
    return grads, act, dw.astype(jnp.float32)


def cuda_dswiglu_dgrad(dout, wo, group_sizes, gate, up, w, *, has_weight: bool, interleaved: bool,
                       config: str):
    """The fused kernel with `config` (tiles in FUSED_TILES): dswiglu_dgrad_reference's outputs.
    dout [M, N], wo [E, H, N], gate / up [M, H] bf16; w [M] f32 (or no_weights()). No fallback."""
    m, h = gate.shape
    half = jax.ShapeDtypeStruct((m, h), gate.dtype)
    grads = (jax.ShapeDtypeStruct((m, 2 * h), gate.dtype), ) if interleaved else (half, half)
    dw = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    *outs, _ = gg.call_kernel(TARGETS[interleaved],
                              grads + (half, dw),
                              dout,
                              wo,
                              group_sizes,
                              gate,
                              up,
                              w,
                              num_groups=group_sizes.shape[0],
                              config=config,
                              tiles=FUSED_TILES,
                              extra_workspace=partial_bytes(m, h, config, has_weight),
                              has_weight=has_weight)
    grads = outs[0] if interleaved else (outs[0], outs[1])
    return grads, outs[-2], outs[-1]


def dswiglu_dgrad(dout,
                  wo,
                  group_sizes,
                  gate,
                  up,
                  w,
                  *,
                  has_weight: bool,
                  interleaved: bool,
                  config: str | None = None):
    """The fused kernel where lowered for CUDA, the reference elsewhere (platform_call)."""
    kw = dict(has_weight=has_weight, interleaved=interleaved)
    if gg.is_empty(gate.shape[0], gate.shape[1], dout.shape[1], wo.shape[0]):
        return dswiglu_dgrad_reference(dout, wo, group_sizes, gate, up, w, **kw)
    cfg = config or choose_config(gate.shape[0], gate.shape[1], dout.shape[1], wo.shape[0])
    return platform_call(lambda *a: cuda_dswiglu_dgrad(*a, **kw, config=cfg),
                         lambda *a: dswiglu_dgrad_reference(*a, **kw), dout, wo, group_sizes, gate,
                         up, w)


def fused_reason(gate, wo, backend: str, act: str = "silu") -> str:
    """'' where the fused kernel runs for these operands, else why not (the ops then run the
    unfused composition). gate: [M, H] (or a ShapeDtypeStruct); wo: [E, H, N]."""
    if act != "silu":
        return f"act={act!r} (the dSwiGLU epilogue computes silu only)"
    if backend == "xla":
        return "kernel_backend='xla'"
    if _backend.op_backend(backend, "grouped_gemm") != "cuda":
        return f"no CUDA grouped GEMM here: {_backend.cuda_status('grouped_gemm')[1]}"
    if _backend.fused_gate_up_reason():
        return ("the dSwiGLU epilogue is sm_90a code on the Hopper grouped GEMM, and the sm_80 "
                f"grouped GEMM runs here ({_backend.grouped_gemm_kernel()[1]})")
    if gate.dtype != jnp.bfloat16 or wo.dtype != jnp.bfloat16:
        return f"the fused kernel takes bf16, got {gate.dtype} and {wo.dtype}"
    if wo.shape[1] % 8 or wo.shape[2] % 8:
        return f"the fused kernel needs H and N multiples of 8, got H={wo.shape[1]}, N={wo.shape[2]}"
    return ""


# ------------------------------------------------------------------- the custom_vjp ops


def _act(gate, up, w, has_weight):
    return swiglu_cuda(gate, up, w if has_weight else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, ))
def _swiglu_down(gate, up, w, wo, group_sizes, impl):
    return gg.fwd_impl(_act(gate, up, w, impl[1]), wo, group_sizes, _GIMPL)


def _sd_fwd(gate, up, w, wo, group_sizes, impl):
    out = gg.fwd_impl(_act(gate, up, w, impl[1]), wo, group_sizes, _GIMPL)
    return out, (gate, up, w, wo, group_sizes)  # act is recomputed by the backward's kernel


def _down_bwd(impl, dout, wo, group_sizes, gate, up, w, interleaved):
    """The backward both ops share: (d(gate, up) as dswiglu_dgrad gives it, the routing
    weights' cotangent, d wo)."""
    config, has_weight = impl
    grads, act, dw = dswiglu_dgrad(dout.astype(gate.dtype),
                                   wo,
                                   group_sizes,
                                   gate,
                                   up,
                                   w,
                                   has_weight=has_weight,
                                   interleaved=interleaved,
                                   config=config)
    dwo = gg.wgrad_impl(act, dout.astype(gate.dtype), group_sizes, _GIMPL).astype(wo.dtype)
    return grads, dw.astype(w.dtype) if has_weight else jnp.zeros_like(w), dwo


def _sd_bwd(impl, res, dout):
    gate, up, w, wo, group_sizes = res
    (dg, du), dw, dwo = _down_bwd(impl, dout, wo, group_sizes, gate, up, w, False)
    return dg, du, dw, dwo, zero_cotangent(group_sizes)


_swiglu_down.defvjp(_sd_fwd, _sd_bwd)


def _check_config(config):
    return None if config is None else gg.config_name(*gg.parse_config(config))


def swiglu_down(gate,
                up,
                wo,
                group_sizes,
                row_weights=None,
                *,
                act: str = "silu",
                backend: str = "auto",
                config: str | None = None):
    """grouped_gemm(act(gate) * up (* row_weights[:, None]), wo, group_sizes) -> [M, N].

    gate, up: [M, H]; wo: [E, H, N]; group_sizes: [E] integer (rows past their sum come out
    zero); row_weights: optional [M] (gradient in their dtype). Where `fused_reason` is '' the
    backward is the dgrad + dSwiGLU kernel (module doc; config forces its configuration, tiles
    in FUSED_TILES), else this is ops.swiglu then ops.grouped_gemm. Differentiable in gate, up,
    wo and row_weights.
    """
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"gate and up must be one [M, H] shape, got {gate.shape}, {up.shape}")
    if wo.ndim != 3 or wo.shape[1] != gate.shape[1]:
        raise ValueError(f"wo must be [E, H={gate.shape[1]}, N], got {wo.shape}")
    if row_weights is not None and row_weights.shape != gate.shape[:1]:
        raise ValueError(f"row_weights must be [M={gate.shape[0]}], got {row_weights.shape}")
    config = _check_config(config)
    why = fused_reason(gate, wo, backend, act)
    if why:
        if config is not None:
            raise ValueError(f"swiglu_down config={config!r} configures the fused kernel, which "
                             f"does not run here: {why}")
        return gg.grouped_gemm(swiglu(gate, up, row_weights, act=act, backend=backend),
                               wo,
                               group_sizes,
                               backend=backend)
    return fused_swiglu_down(gate, up, wo, group_sizes, row_weights, config=config)


def fused_swiglu_down(gate, up, wo, group_sizes, row_weights=None, *, config=None):
    """swiglu_down's fused op whatever the platform: the kernels where lowered for CUDA, their
    references elsewhere (the same custom_vjp; swiglu_down decides where it runs)."""
    if row_weights is None:
        gate, up = vary_together(gate, up.astype(gate.dtype))
        w = no_weights()
    else:
        gate, up, w = vary_together(gate, up.astype(gate.dtype), row_weights.astype(jnp.float32))
    return _swiglu_down(gate, up, w, wo, group_sizes.astype(jnp.int32),
                        (config, row_weights is not None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, ))
def _gate_up_swiglu_down(lhs, w_gate_up, wo, group_sizes, w, impl):
    return _gus_fwd(lhs, w_gate_up, wo, group_sizes, w, impl)[0]


def _gate_up_fwd(lhs, w_gate_up, group_sizes, w, has_weight):
    cfg = _gate_up.choose_fused_config(lhs.shape[0], lhs.shape[1], w_gate_up.shape[2],
                                       group_sizes.shape[0])
    ref = lambda a, b, g, ww: _gate_up.gate_up_swiglu_reference(  # noqa: E731
        a, b, g, ww if has_weight else None)
    return platform_call(lambda a, b, g, ww: _gate_up.cuda_fwd(a, b, g, ww, has_weight, cfg), ref,
                         lhs, w_gate_up, group_sizes, w)


def _gus_fwd(lhs, w_gate_up, wo, group_sizes, w, impl):
    gate, up, act = _gate_up_fwd(lhs, w_gate_up, group_sizes, w, impl[1])
    gate, up = named_gate_up(gate, up)
    out = gg.fwd_impl(act, wo, group_sizes, _GIMPL)
    return out, (lhs, w_gate_up, wo, group_sizes, w, gate, up)


def _gus_bwd(impl, res, dout):
    lhs, w_gate_up, wo, group_sizes, w, gate, up = res
    dh, dw, dwo = _down_bwd(impl, dout, wo, group_sizes, gate, up, w, True)
    dlhs = gg.dgrad_impl(dh, w_gate_up, group_sizes, _GIMPL)
    dw_gate_up = gg.wgrad_impl(lhs, dh, group_sizes, _GIMPL).astype(w_gate_up.dtype)
    return dlhs, dw_gate_up, dwo, zero_cotangent(group_sizes), dw


_gate_up_swiglu_down.defvjp(_gus_fwd, _gus_bwd)


def gate_up_swiglu_down(lhs,
                        w_gate_up,
                        wo,
                        group_sizes,
                        row_weights=None,
                        *,
                        act: str = "silu",
                        backend: str = "auto",
                        config: str | None = None):
    """grouped_gemm(ops.gate_up_swiglu(lhs, w_gate_up, group_sizes, row_weights), wo,
    group_sizes) -> [M, N]: the fused gate/up forward, and in the backward the dgrad + dSwiGLU
    kernel writing the interleaved d(gate, up) that the gate/up dgrad and wgrad read.

    lhs [M, K]; w_gate_up [E, K, 2H] (interleaved, ops.gate_up); wo [E, H, N]. Where
    `fused_reason` (or ops.gate_up_swiglu's own checks) rules the fused kernels out, this is
    ops.gate_up_swiglu then ops.grouped_gemm. config: the dSwiGLU kernel's configuration.
    """
    if w_gate_up.ndim != 3 or wo.ndim != 3 or 2 * wo.shape[1] != w_gate_up.shape[2]:
        raise ValueError(f"gate_up_swiglu_down needs w_gate_up [E, K, 2H], wo [E, H, N]; got "
                         f"{w_gate_up.shape}, {wo.shape}")
    config = _check_config(config)
    gate = jax.ShapeDtypeStruct((lhs.shape[0], wo.shape[1]), lhs.dtype)
    why = fused_reason(gate, wo, backend, act) or (_gate_up._unsupported(lhs, w_gate_up, act) or "")
    if why:
        if config is not None:
            raise ValueError(f"gate_up_swiglu_down config={config!r} configures the fused "
                             f"kernel, which does not run here: {why}")
        h = _gate_up.gate_up_swiglu(lhs,
                                    w_gate_up,
                                    group_sizes,
                                    row_weights,
                                    act=act,
                                    backend=backend)
        return gg.grouped_gemm(h, wo, group_sizes, backend=backend)
    return fused_gate_up_swiglu_down(lhs, w_gate_up, wo, group_sizes, row_weights, config=config)


def fused_gate_up_swiglu_down(lhs, w_gate_up, wo, group_sizes, row_weights=None, *, config=None):
    """gate_up_swiglu_down's fused op whatever the platform (as fused_swiglu_down)."""
    if row_weights is None:
        w = no_weights()
    else:
        lhs, w = vary_together(lhs, row_weights.astype(jnp.float32))
    return _gate_up_swiglu_down(lhs, w_gate_up, wo, group_sizes.astype(jnp.int32), w,
                                (config, row_weights is not None))
