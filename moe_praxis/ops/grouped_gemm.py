"""Grouped GEMM with jax.lax.ragged_dot semantics, and its CUDA (CUTLASS sm_90a) backend.

    out[i] = lhs[i] @ rhs[g(i)]   for rows i < sum(group_sizes), g(i) the group of row i
    out[i] = 0                    for rows i >= sum(group_sizes)

lhs: [M, K]; rhs: [E, K, N]; group_sizes: [E] int32 (rows of each group, contiguous, in
order). Gradients (a custom_vjp, the same for every backend):

    dlhs = grouped_gemm(dout, rhs^T, group_sizes)            [M, K]  (dgrad)
    drhs[e] = lhs_e^T @ dout_e                              [E, K, N] (wgrad; zero if e is empty)

group_sizes gets no gradient.

Backends ('auto' | 'xla' | 'cuda', see `moe_praxis.ops.backend`):
  xla:  `jax.lax.ragged_dot` / `jax.lax.ragged_dot_general` (every platform; the test oracle).
  cuda: three FFI kernels per kernel family, chosen by backend.grouped_gemm_kernel:
        'sm90' (compute capability 9.0): kernels/grouped_gemm_{fwd,dgrad,wgrad}.cu, CUTLASS's
        Hopper pointer-array grouped GEMM (warp-specialized, TMA), bf16 in, fp32 accumulate,
        bf16 out; 'sm80' (every other GPU from 8.0, fp16 inputs on Hopper, or forced with
        MOE_PRAXIS_GROUPED_GEMM=sm80): kernels/grouped_gemm_sm80_*.cu, CUTLASS 2.x GemmGrouped
        (mma.sync), bf16 or fp16 (ops.grouped_gemm_sm80). Group sizes are read on the device
        (no host copy, no sync; CUDA-graph safe). Needs compute capability 8.0 or newer
        (backend.COMPUTE_CAPABILITY): 'auto' falls back to xla elsewhere; a resolved 'cuda'
        (the block's) falls back with a warning where only this requirement is unmet, and
        raises, saying why, where no GPU or library is usable. Takes K and N multiples of 8
        (16-byte rows); other problems (float32, odd K or N) run the xla reference under 'auto'
        and 'cuda' alike, with a warning naming the reason (once per reason). The xla path on
        a GPU warns once more: ragged_dot there computes E times the useful work.
Group sizes are clamped to [0, rows left] (negative sizes count as 0; a sum past M is cut at
M), on every backend's CUDA path; valid inputs (sizes >= 0, sum <= M) need no clamping.

Kernel configurations of the CUDA kernels (a compiled tile from TILE_CONFIGS, a raster order
and a swizzle: `parse_config`) and the rule that picks one, `choose_config`, live in
ops.grouped_gemm_tiles (re-exported here) and are documented in docs/grouped_gemm.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call
from moe_praxis.ops.grouped_gemm_sm80 import (  # noqa: F401  (re-exported)
    SM80_DTYPES, SM80_TARGETS, SM80_TILE_CONFIGS, choose_sm80_config, is_sm80_config,
    parse_sm80_config, run_sm80_kernel, sm80_shared_memory, sm80_tile_shape,
    sm80_unsupported_reason, sm80_workspace_bytes)
from moe_praxis.ops.grouped_gemm_tiles import (  # noqa: F401  (re-exported)
    ADAPTIVE_TILE, ADAPTIVE_TILES, CLUSTERS, CUTLASS_WORKSPACE_BYTES, ENV_TILE,
    GROUP_ARRAY_BYTES_PER_GROUP, OPS, RASTERS, SPLIT_ROWS_MULTIPLE, SWIZZLES, TILE_CONFIGS,
    adaptive_choice, choose_config, config_name, num_problems, parse_config, parse_split,
    workspace_bytes)
from moe_praxis.ops.vma import zero_cotangent

# FFI target of each of the three GEMMs
TARGETS = {
    "fwd": "moe_grouped_gemm_fwd",
    "dgrad": "moe_grouped_gemm_dgrad",
    "wgrad": "moe_grouped_gemm_wgrad",
}

# ----------------------------------------------------------------------------- references


def grouped_gemm_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """Pure-JAX reference: jax.lax.ragged_dot. lhs [M,K], rhs [E,K,N] -> [M,N]."""
    return jax.lax.ragged_dot(lhs,
                              rhs,
                              group_sizes.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)


def grouped_gemm_dgrad_reference(dout, rhs, group_sizes):
    """dlhs [M,K] = grouped dout [M,N] x rhs[e]^T [N,K] (ragged_dot against rhs^T)."""
    return jax.lax.ragged_dot(dout, jnp.swapaxes(rhs, 1, 2), group_sizes.astype(jnp.int32))


def grouped_gemm_wgrad_reference(lhs, dout, group_sizes):
    """drhs [E,K,N]: drhs[e] = lhs_e^T @ dout_e, zero for empty groups (ragged_dot_general)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(lhs,
                                     dout,
                                     group_sizes.astype(jnp.int32),
                                     dims,
                                     preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


# ------------------------------------------------------------------------- CUDA kernels


def call_kernel(target: str,
                results,
                *args,
                num_groups: int,
                config: str,
                tiles=None,
                extra_workspace: int = 0,
                **attrs):
    """One grouped GEMM FFI call: `results` (ShapeDtypeStructs) plus the workspace sized for
    `num_groups` groups (and the row split's pieces of the first argument's rows) and the
    configuration's tile, plus `extra_workspace` bytes the kernel takes at its end, with the
    configuration's tile / raster / swizzle / split_rows attributes and `attrs`. tiles: the
    tiles `target` is built for (None: all). Returns the results, then the workspace."""
    tile, raster, swizzle, split_rows = parse_config(config)
    if tiles is not None and tile not in tiles:
        raise ValueError(f"{target}: config {config!r}: tile {TILE_CONFIGS[tile]!r} is not "
                         f"built; valid: {[TILE_CONFIGS[t] for t in tiles]}")
    if target == TARGETS["wgrad"]:
        split_rows = 0  # wgrad's rows are its contraction: never split (the kernel ignores it)
    problems = num_problems(num_groups, args[0].shape[0], split_rows)
    ws = jax.ShapeDtypeStruct((workspace_bytes(problems, tile) + extra_workspace, ), jnp.uint8)
    return ffi(target,
               tuple(results) + (ws, ),
               *args,
               tile=tile,
               raster=raster,
               swizzle=swizzle,
               split_rows=split_rows,
               **attrs)


def run_kernel(op: str, out_shape, a, b, group_sizes, config: str, with_workspace: bool = False):
    """One of the three GEMMs ('fwd' | 'dgrad' | 'wgrad') as its FFI call with `config`: the
    [out_shape] result in a.dtype (and, with_workspace, the workspace too: adaptive_choice reads
    it). No fallback, no vjp."""
    out, workspace = call_kernel(TARGETS[op], (jax.ShapeDtypeStruct(out_shape, a.dtype), ),
                                 a,
                                 b,
                                 group_sizes.astype(jnp.int32),
                                 num_groups=group_sizes.shape[0],
                                 config=config)
    return (out, workspace) if with_workspace else out


def cuda_fwd(lhs, rhs, group_sizes, config: str):
    """CUDA forward: lhs [M,K] bf16, rhs [E,K,N] bf16 -> [M,N] bf16 (no fallback, no vjp)."""
    return run_kernel("fwd", (lhs.shape[0], rhs.shape[2]), lhs, rhs, group_sizes, config)


def cuda_dgrad(dout, rhs, group_sizes, config: str):
    """CUDA dgrad: dout [M,N] bf16, rhs [E,K,N] bf16 -> dlhs [M,K] bf16."""
    return run_kernel("dgrad", (dout.shape[0], rhs.shape[1]), dout, rhs, group_sizes, config)


def cuda_wgrad(lhs, dout, group_sizes, config: str):
    """CUDA wgrad: lhs [M,K] bf16, dout [M,N] bf16 -> drhs [E,K,N] bf16."""
    return run_kernel("wgrad", (group_sizes.shape[0], lhs.shape[1], dout.shape[1]), lhs, dout,
                      group_sizes, config)


def cuda_unsupported_reason(lhs, rhs) -> str | None:
    """Why the CUDA kernels of the family that runs these inputs here (backend.
    grouped_gemm_kernel) cannot run this problem (None if they can; device not checked)."""
    if _backend.grouped_gemm_kernel(dtype=lhs.dtype)[0] == "sm80":
        return sm80_unsupported_reason(lhs, rhs)
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16:
        return f"the CUDA grouped GEMM takes bf16 lhs and rhs, got {lhs.dtype} and {rhs.dtype}"
    k, n = rhs.shape[1], rhs.shape[2]
    if k % 8 or n % 8:
        return f"the CUDA grouped GEMM needs K and N multiples of 8, got K={k}, N={n}"
    return None


def resolve(backend: str, lhs, rhs, op: str = "grouped_gemm") -> str:
    """'xla' or 'cuda' for one call: backend.op_backend (a resolved backend is not resolved
    again; 'auto' is), then the problem check against the kernel family that will run
    (backend.grouped_gemm_kernel). A problem the kernels do not take (a dtype other than bf16,
    or fp16 for the sm_80 kernels; K or N not a multiple of 8) runs the XLA reference under
    'auto' and 'cuda' alike, with a warning (once per reason) naming the reason: moe_block
    passes its resolved backend to every op, so a float32 model on a GPU must still run. Where
    the result is 'xla' on a GPU, a second warning names ragged_dot's cost there."""
    if backend == "xla":
        _backend.warn_xla_on_gpu(op, "kernel_backend='xla'")
        return "xla"
    if _backend.op_backend(backend, op) == "xla":
        _backend.warn_xla_on_gpu(op, f"no usable kernel: {_backend.cuda_status(op)[1]}")
        return "xla"
    why = cuda_unsupported_reason(lhs, rhs)
    if why is None:
        return "cuda"
    _backend.warn_fallback(op, why)
    _backend.warn_xla_on_gpu(op, why)
    return "xla"


# ----------------------------------------------------------------------- custom_vjp op


def is_empty(m, k, n, e) -> bool:
    """Problems with a zero-sized dimension: computed by the reference (all zeros)."""
    return 0 in (m, k, n, e)


def kernel_config(op: str,
                  dims,
                  dtype,
                  config: str | None,
                  family: str | None = None) -> tuple[str, str]:
    """(kernel family, configuration) of one CUDA GEMM: `family` (the op's, fixed when it was
    called) or the one backend.grouped_gemm_kernel picks for `dtype`, and `config` (checked
    against that family) or the family's rule for the forward dims (m, k, n, e)."""
    kernel, why = ((family, f"the {family} family the op was called with")
                   if family else _backend.grouped_gemm_kernel(dtype=dtype))
    if config is not None and is_sm80_config(config) != (kernel == "sm80"):
        valid = SM80_TILE_CONFIGS if kernel == "sm80" else TILE_CONFIGS
        raise ValueError(f"grouped GEMM config {config!r} is not a configuration of the {kernel} "
                         f"kernels that run here ({why}); valid tiles: {valid}")
    if config is not None:
        return kernel, config
    if kernel == "sm80":
        return kernel, choose_sm80_config(op, *dims, _backend.shared_memory_per_block())
    return kernel, choose_config(op, *dims)


def _run(op, dims, reference, cuda_fn, a, b, group_sizes, impl):
    """One of the three GEMMs: the reference for impl 'xla' or an empty problem, else the CUDA
    kernel of impl's family (impl: (backend, config, family); the family is read when the op
    is called, so its forward and backward, traced later, cannot run different families),
    configuration impl's or the family's rule for the forward dims (m, k, n, e)."""
    if impl[0] == "xla" or is_empty(*dims):
        return reference(a, b, group_sizes)
    kernel, cfg = kernel_config(op, dims, a.dtype, impl[1], impl[2] if len(impl) > 2 else None)
    if kernel == "sm80":
        m, k, n, e = dims
        out_shape = {"fwd": (m, n), "dgrad": (m, k), "wgrad": (e, k, n)}[op]
        cuda_fn = lambda x, y, g, c: run_sm80_kernel(op, out_shape, x, y, g, c)  # noqa: E731
    return platform_call(lambda x, y, g: cuda_fn(x, y, g, cfg), reference, a, b, group_sizes)


def fwd_impl(lhs, rhs, group_sizes, impl):
    (m, k), (e, _, n) = lhs.shape, rhs.shape
    return _run("fwd", (m, k, n, e),
                lambda a, b, g: grouped_gemm_reference(a, b, g).astype(a.dtype), cuda_fwd, lhs, rhs,
                group_sizes, impl)


def dgrad_impl(dout, rhs, group_sizes, impl):
    (m, n), (e, k, _) = dout.shape, rhs.shape
    return _run("dgrad", (m, k, n, e),
                lambda a, b, g: grouped_gemm_dgrad_reference(a, b, g).astype(a.dtype), cuda_dgrad,
                dout, rhs, group_sizes, impl)


def wgrad_impl(lhs, dout, group_sizes, impl):
    (m, k), n, e = lhs.shape, dout.shape[1], group_sizes.shape[0]
    return _run("wgrad", (m, k, n, e), grouped_gemm_wgrad_reference, cuda_wgrad, lhs, dout,
                group_sizes, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _grouped_gemm(lhs, rhs, group_sizes, impl):
    return fwd_impl(lhs, rhs, group_sizes, impl)


def _vjp_fwd(lhs, rhs, group_sizes, impl):
    return fwd_impl(lhs, rhs, group_sizes, impl), (lhs, rhs, group_sizes)


def _vjp_bwd(impl, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = dgrad_impl(dout, rhs, group_sizes, impl)
    drhs = wgrad_impl(lhs, dout, group_sizes, impl).astype(rhs.dtype)
    return dlhs, drhs, zero_cotangent(group_sizes)


_grouped_gemm.defvjp(_vjp_fwd, _vjp_bwd)


def grouped_gemm(lhs, rhs, group_sizes, *, backend: str = "auto", config: str | None = None):
    """[M, K] x [E, K, N] -> [M, N] grouped by `group_sizes`; output in lhs.dtype.

    lhs: [M, K]; rhs: [E, K, N]; group_sizes: [E] integer (rows of each expert, contiguous,
    in order; rows past their sum come out zero). backend: 'auto' | 'xla' | 'cuda' (module
    doc). config: force one CUDA kernel configuration (`parse_config` form, e.g.
    'coop_256x128_c2x1/along_m/s1') for the forward, dgrad and wgrad GEMMs; default: the
    environment variable MOE_PRAXIS_GG_TILE, else `choose_config` per GEMM. Differentiable in
    lhs and rhs (custom_vjp: dgrad and wgrad are grouped GEMMs too).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_gemm needs lhs [M,K], rhs [E,K,N]; got {lhs.shape}, {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0], ):
        raise ValueError(f"group_sizes must be [E={rhs.shape[0]}], got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got dtype {group_sizes.dtype}")
    if config is not None:
        config = (SM80_TILE_CONFIGS[parse_sm80_config(config)]
                  if is_sm80_config(config) else config_name(*parse_config(config)))
    return _grouped_gemm(lhs, rhs, group_sizes.astype(jnp.int32),
                         resolve_impl(backend, lhs, rhs, config))


def resolve_impl(backend: str, lhs, rhs, config: str | None = None) -> tuple:
    """The static `impl` (backend, config, kernel family) that fwd_impl, dgrad_impl and
    wgrad_impl run one grouped GEMM of lhs [M, K] (an array or ShapeDtypeStruct) and rhs
    [E, K, N] with: `resolve`'s backend; config as grouped_gemm's (None: each GEMM's rule)."""
    resolved = resolve(backend, lhs, rhs)
    # the kernel family is part of the op's static arguments: fixed here, at the call, for the
    # forward and the backward alike, and a key of any trace cache that holds them
    family = _backend.grouped_gemm_kernel(dtype=lhs.dtype)[0] if resolved == "cuda" else None
    return (resolved, config, family)
