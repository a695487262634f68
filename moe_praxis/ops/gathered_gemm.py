"""Gathered grouped GEMMs: expert projections that read the token rows of x by the dispatch's
row map, with no permuted copy of x forward or backward.

    outs[i][r] = x[row_map[r]] @ rhs[i][e(r)]    (a zero row where row_map[r] is outside [0, T))

that is, grouped_gemm(permute(x, row_map), rhs[i], group_sizes) for each weight in `rhs` (one,
or the gate and up projections' two), rows past sum(group_sizes) zero. Gradients (custom_vjp):

    drows_i = grouped dgrad(dout_i, rhs[i])               [R, K]
    dx      = unpermute(sum_i drows_i, row_map, T)        [T, K]  (one pass over both)
    drhs_i[e] = sum over e's rows r of x[row_map[r]]^T dout_i[r]

The backward keeps x, row_map, the permute index and the weights: not the [R, K] rows that a
permute followed by grouped_gemm saves for its wgrad.

Backends ('auto' | 'xla' | 'cuda'):
  xla:  the references (the permute as a gather, jax.lax.ragged_dot; the gathered rows
        recomputed in the backward).
  cuda: kernels/grouped_gemm_gather.cu for the forward and the wgrad (Hopper, bf16: A's rows
        loaded by index with cp.async beside B's TMA), the grouped GEMM's dgrad kernel, and the
        indexed unpermute kernel (ops.permute) summing both projections' row gradients.
`gather_unsupported` says where the cuda path cannot run (other kernel families, dtypes,
shapes): callers keep the permute path there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.grouped_gemm import (cuda_unsupported_reason, dgrad_impl,
                                         grouped_gemm_reference, grouped_gemm_wgrad_reference)
from moe_praxis.ops.permute import (permute_index_cuda, permute_reference, unpermute2_reference,
                                    unpermute_reference, unpermute_rows)
from moe_praxis.ops.grouped_gemm_tiles import (TILE_CONFIGS, choose_config, config_name,
                                               num_problems, parse_config, workspace_bytes)
from moe_praxis.ops.vma import zero_cotangent

TARGETS = {"fwd": "moe_grouped_gemm_gather_fwd", "wgrad": "moe_grouped_gemm_gather_wgrad"}
# The tiles the gathered kernels are built for (kernels/grouped_gemm_gather.cu,
# dispatch_gather_tile): those the rule picks for the forward and the wgrad. A configuration
# with another tile runs on ping-pong 128x192 (1x1 cluster) with its raster, swizzle and split.
GATHER_TILES = (1, 10, 11)
_FALLBACK_TILE = TILE_CONFIGS.index("pingpong_128x192_c1x1")


def gather_config(op: str, m: int, k: int, n: int, e: int) -> str:
    """The gathered kernel's configuration for the forward dims (rows m, K, N, experts e): the
    grouped GEMM's rule (ops.grouped_gemm_tiles.choose_config, MOE_PRAXIS_GG_TILE included) on
    a tile the gathered kernels are built for."""
    tile, raster, swizzle, split = parse_config(choose_config(op, m, k, n, e))
    if tile not in GATHER_TILES:
        tile, raster = _FALLBACK_TILE, 0
    return config_name(tile, raster, swizzle, split)


# ----------------------------------------------------------------------------- references


def forward_reference(x, row_map, rhs, group_sizes):
    """The forward as a permute (a gather) and jax.lax.ragged_dot: outs in x.dtype."""
    rows = permute_reference(x, row_map)
    return tuple(grouped_gemm_reference(rows, w, group_sizes).astype(x.dtype) for w in rhs)


def wgrad_reference(x, row_map, dout, group_sizes):
    """drhs [E, K, N] of one projection: the gathered rows' ragged wgrad."""
    return grouped_gemm_wgrad_reference(permute_reference(x, row_map), dout, group_sizes)


# ------------------------------------------------------------------------- CUDA kernels


def call_gathered(target: str,
                  results,
                  x,
                  row_map,
                  *args,
                  num_groups: int,
                  config: str,
                  wgrad: bool = False,
                  **attrs):
    """One gathered kernel's FFI call (x and row_map first, then `args`): `results` plus the
    workspace for `num_groups` groups and the row split's pieces of row_map's rows, with the
    configuration's attributes (its tile in GATHER_TILES) and `attrs`. Returns the results."""
    tile, raster, swizzle, split_rows = parse_config(config)
    if tile not in GATHER_TILES:
        raise ValueError(f"{target}: config {config!r}: tile {TILE_CONFIGS[tile]!r} is not "
                         f"built; valid: {[TILE_CONFIGS[t] for t in GATHER_TILES]}")
    if wgrad:
        split_rows = 0  # the wgrad's rows are its contraction
    problems = num_problems(num_groups, row_map.shape[0], split_rows)
    ws = jax.ShapeDtypeStruct((workspace_bytes(problems, tile), ), jnp.uint8)
    return ffi(target,
               tuple(results) + (ws, ),
               x,
               row_map,
               *args,
               tile=tile,
               raster=raster,
               swizzle=swizzle,
               split_rows=split_rows,
               **attrs)[:-1]


def cuda_fwd(x, row_map, rhs, group_sizes, config: str):
    """The gathered forward kernel: x [T, K], row_map [R] int32, rhs [E, K, N] (bf16) -> [R, N]."""
    out = jax.ShapeDtypeStruct((row_map.shape[0], rhs.shape[2]), x.dtype)
    return call_gathered(TARGETS["fwd"], (out, ),
                         x,
                         row_map,
                         rhs,
                         group_sizes,
                         num_groups=group_sizes.shape[0],
                         config=config)[0]


def cuda_wgrad(x, row_map, dout, group_sizes, config: str):
    """The gathered wgrad kernel: x [T, K], row_map [R], dout [R, N] -> drhs [E, K, N]."""
    out = jax.ShapeDtypeStruct((group_sizes.shape[0], x.shape[1], dout.shape[1]), x.dtype)
    return call_gathered(TARGETS["wgrad"], (out, ),
                         x,
                         row_map,
                         dout,
                         group_sizes,
                         num_groups=group_sizes.shape[0],
                         config=config,
                         wgrad=True)[0]


def gather_unsupported(x, rhs, backend: str = "auto") -> str:
    """'' where the gathered kernels run these inputs (backend resolving to cuda, the Hopper
    grouped GEMM family, bf16 x and weights, K and N multiples of 8, x with rows: its tensor
    map needs one), else why not."""
    if x.shape[0] == 0:
        return "x has no rows (the gathered kernels' tensor map of x needs at least one)"
    if _backend.op_backend(backend, "grouped_gemm") != "cuda":
        return f"the grouped GEMM runs the XLA reference here (kernel_backend={backend!r})"
    family, why = _backend.grouped_gemm_kernel(dtype=x.dtype)
    if family != "sm90":
        return f"the gathered kernels are Hopper (sm_90a) code and the {family} family runs: {why}"
    for w in rhs:
        why = cuda_unsupported_reason(x, w)
        if why:
            return why
    return ""


# ----------------------------------------------------------------------- custom_vjp op


def _fwd_outs(x, row_map, rhs, group_sizes, impl):
    if impl == "xla":
        return forward_reference(x, row_map, rhs, group_sizes)
    (t, k), r, e = x.shape, row_map.shape[0], group_sizes.shape[0]

    def one(w):
        cfg = gather_config("fwd", r, k, w.shape[2], e)
        return platform_call(lambda a, m, b, g: cuda_fwd(a, m, b, g, cfg),
                             lambda a, m, b, g: forward_reference(a, m, (b, ), g)[0], x, row_map, w,
                             group_sizes)

    return tuple(one(w) for w in rhs)


def gathered_wgrad(x, row_map, dout, group_sizes, impl: str):
    """drhs [E, K, N] of the rows x[row_map] against dout [R, N]: the gathered wgrad kernel for
    impl 'cuda' (where lowered for CUDA), else the reference. For backward passes (no vjp)."""
    if impl == "xla":
        return wgrad_reference(x, row_map, dout, group_sizes)
    cfg = gather_config("wgrad", row_map.shape[0], x.shape[1], dout.shape[1], group_sizes.shape[0])
    return platform_call(lambda a, m, d, g: cuda_wgrad(a, m, d, g, cfg), wgrad_reference, x,
                         row_map, dout, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, ))
def _gathered(x, row_map, index, rhs, group_sizes, impl):
    return _fwd_outs(x, row_map, rhs, group_sizes, impl)


def _vjp_fwd(x, row_map, index, rhs, group_sizes, impl):
    return _fwd_outs(x, row_map, rhs, group_sizes, impl), (x, row_map, index, rhs, group_sizes)


def _vjp_bwd(impl, res, douts):
    x, row_map, index, rhs, group_sizes = res
    douts = tuple(d.astype(x.dtype) for d in douts)
    gg_impl = ("xla", None, None) if impl == "xla" else ("cuda", None, "sm90")
    drows = [dgrad_impl(d, w, group_sizes, gg_impl) for d, w in zip(douts, rhs)]
    t = x.shape[0]
    if impl == "xla":
        dx = unpermute_reference(drows[0], row_map, t) if len(drows) == 1 else \
            unpermute2_reference(drows[0], drows[1], row_map, t)
    else:
        dx = unpermute_rows(drows[0], row_map, t, index, drows[1] if len(drows) == 2 else None)
    if impl == "xla":  # the rows gathered again, once for both wgrads
        rows = permute_reference(x, row_map)
        drhs = tuple(
            grouped_gemm_wgrad_reference(rows, d, group_sizes).astype(w.dtype)
            for d, w in zip(douts, rhs))
    else:
        drhs = tuple(
            gathered_wgrad(x, row_map, d, group_sizes, impl).astype(w.dtype)
            for d, w in zip(douts, rhs))
    d_index = None if index is None else zero_cotangent(index)
    return dx, zero_cotangent(row_map), d_index, drhs, zero_cotangent(group_sizes)


_gathered.defvjp(_vjp_fwd, _vjp_bwd)


def resolve_gathered(name: str, op: str, backend: str, unsupported, x, row_map, index):
    """(impl, row_map as int32, index) of a gathered op `name`: impl 'cuda' where `op`'s backend
    resolves to cuda (then unsupported() must be '', else a ValueError naming why: callers keep
    the permute there) with the permute index made if not given, else 'xla' and no index."""
    row_map = row_map.astype(jnp.int32)
    if _backend.op_backend(backend, op) != "cuda":
        return "xla", row_map, None
    why = unsupported()
    if why:
        raise ValueError(f"{name} cannot run the CUDA kernels here: {why}; use the permute and "
                         "the op on the permuted rows")
    if index is None:
        index = permute_index_cuda(row_map, x.shape[0])
    return "cuda", row_map, index


def gathered_gemm(x, row_map, rhs: tuple, group_sizes, *, backend: str = "auto", index=None):
    """x: [T, K]; row_map: [R] int (x's row of each expert-sorted row; outside [0, T): a zero
    row); rhs: a tuple of one or two [E, K, N] weights; group_sizes: [E] -> a tuple of [R, N]
    outputs in x.dtype, one per weight (module doc). backend: 'auto' | 'xla' | 'cuda'; the
    cuda path needs gather_unsupported(x, rhs) == '' (else this raises: callers keep the permute
    there). index: ops.permute_index(row_map, T) for the backward's unpermute (made here on
    the cuda path if not given). Differentiable in x and the weights."""
    if x.ndim != 2 or row_map.ndim != 1 or not 1 <= len(rhs) <= 2:
        raise ValueError(f"gathered_gemm needs x [T,K], row_map [R] and one or two weights; got "
                         f"x {x.shape}, row_map {row_map.shape}, {len(rhs)} weights")
    for w in rhs:
        if w.ndim != 3 or w.shape[1] != x.shape[1] or w.shape[0] != group_sizes.shape[0]:
            raise ValueError(f"gathered_gemm: weight {w.shape} is invalid; valid: [E="
                             f"{group_sizes.shape[0]}, K={x.shape[1]}, N]")
    if not jnp.issubdtype(row_map.dtype, jnp.integer):
        raise ValueError(f"row_map must be integers, got dtype {row_map.dtype}")
    impl, row_map, index = resolve_gathered("gathered_gemm", "grouped_gemm", backend,
                                            lambda: gather_unsupported(x, rhs, "cuda"), x, row_map,
                                            index)
    rhs = tuple(w.astype(x.dtype) for w in rhs)
    return _gathered(x, row_map, index, rhs, group_sizes.astype(jnp.int32), impl)
