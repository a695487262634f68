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
  cuda: three FFI kernels from kernels/grouped_gemm_{fwd,dgrad,wgrad}.cu: CUTLASS's Hopper
        pointer-array grouped GEMM (warp-specialized, TMA), bf16 in, fp32 accumulate, bf16 out.
        Group sizes are read on the device (no host copy, no sync; CUDA-graph safe).
        Needs a compute capability 9.0 GPU (sm_90a code): 'auto' falls back to xla
        elsewhere, 'cuda' raises an error saying why. Takes bf16 lhs and rhs with K and N
        multiples of 8 (16-byte rows for TMA); other problems run the xla reference under
        'auto' and 'cuda' alike, with a warning naming the reason (once per reason).
Group sizes are clamped to [0, rows left] (negative sizes count as 0; a sum past M is cut at
M), on every backend's CUDA path; valid inputs (sizes >= 0, sum <= M) need no clamping.

Kernel configurations of the CUDA kernels (a compiled tile from TILE_CONFIGS, a raster order
and a swizzle: `parse_config`) and the rule that picks one, `choose_config`, are documented in
docs/grouped_gemm.md with the measurements they come from.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops import cuda as _cuda

# Compiled tile configurations. Index = the `tile` attribute of the FFI handlers
# (kernels/grouped_gemm.cuh, dispatch_tile).
TILE_CONFIGS = (
    "coop_256x128_c2x1",  # 0: cooperative, tile 256x128x64, cluster 2x1
    "pingpong_128x128_c2x1",  # 1: ping-pong, tile 128x128x64, cluster 2x1
    "coop_128x256_c2x1",  # 2: cooperative, tile 128x256x64, cluster 2x1
    "pingpong_64x256_c2x1",  # 3: ping-pong, tile 64x256x64, cluster 2x1 (ragged small groups)
    # 4: tiles 2 or 3, chosen on the device at every call from the group sizes (the tiles each
    # would issue; kernels/grouped_gemm.cuh, Adaptive)
    "adaptive_128x256_64x256",
    # 5-7: 2, 3 and 4 with 1x2 clusters (A multicast; a problem's column tiles are rounded up
    # to even counts instead of its row tiles)
    "coop_128x256_c1x2",
    "pingpong_64x256_c1x2",
    "adaptive_128x256_64x256_c1x2",
    # 8-10: 2, 3 and 4 with 1x1 clusters (no multicast, no rounding)
    "coop_128x256_c1x1",
    "pingpong_64x256_c1x1",
    "adaptive_128x256_64x256_c1x1",
    # 11-12 (experiment): 8 with the A/B (mainloop) or D (epilogue) descriptor update twice
    "coop_128x256_c1x1_twiceab",
    "coop_128x256_c1x1_twiced",
)
# The adaptive pairs (their workspace holds the choice); 4 is the 2x1-cluster one.
ADAPTIVE_TILES = tuple(i for i, t in enumerate(TILE_CONFIGS) if t.startswith("adaptive_"))
ADAPTIVE_TILE = TILE_CONFIGS.index("adaptive_128x256_64x256")
# (cluster rows, cluster columns) of each tile configuration: its `_cMxN` suffix, else 2x1 (the
# 2x1 adaptive pair's name has none)
CLUSTERS = tuple(
    tuple(int(v) for v in m.groups()) if (m := re.search(r"_c(\d)x(\d)(?=_|$)", t)) else (2, 1)
    for t in TILE_CONFIGS)
# Run-time scheduling of the persistent tile scheduler (FFI attributes `raster`, `swizzle`):
# the order in which a group's output tiles are handed out, and the swizzle width. (Without
# host problem shapes CUTLASS's group scheduler derives swizzle 1 whatever is passed: see
# docs/grouped_gemm.md.)
RASTERS = ("along_m", "along_n")
SWIZZLES = (1, 2, 4, 8)
# Row split (FFI attribute `split_rows`, config suffix `/rROWS`): fwd and dgrad (and the fused
# gate/up forward) issue each group's rows as problems of at most ROWS rows, so that a wave of
# CTAs never streams one large group's whole row block per column band (kernels/
# grouped_gemm.cuh, num_problems). 0: one problem per group. wgrad ignores it (its rows are the
# contraction).
SPLIT_ROWS_MULTIPLE = 256
# Environment variable that forces one kernel configuration (see `parse_config`) for all three
# GEMMs; unset: `choose_config`.
ENV_TILE = "MOE_PRAXIS_GG_TILE"

OPS = ("fwd", "dgrad", "wgrad")
# Workspace of one FFI call: per-group arrays (kernels/grouped_gemm.cuh:
# kGroupArrayBytesPerGroup bytes a group, rounded up to 256) + CUTLASS's own workspace (TMA
# descriptors, 128 bytes x a few per SM: ~70 KB on 132 SMs), bounded here; the kernel checks
# the real size and fails with a message naming this constant if it were too small.
_GROUP_ARRAY_BYTES_PER_GROUP = 128
_CUTLASS_WORKSPACE_BYTES = 1 << 20
_TARGETS = {
    "fwd": "moe_grouped_gemm_fwd",
    "dgrad": "moe_grouped_gemm_dgrad",
    "wgrad": "moe_grouped_gemm_wgrad",
}

_SHAPE_BYTES = 12  # one group's (M, N, K) int32 problem shape


def _round256(n: int) -> int:
    return (n + 255) // 256 * 256


def num_problems(num_groups: int, rows: int = 0, split_rows: int = 0) -> int:
    """CUTLASS problems of one call: one per group, plus at most rows // split_rows more pieces
    with a row split (kernels/grouped_gemm.cuh, num_problems)."""
    return num_groups + (rows // split_rows if split_rows > 0 else 0)


def _choice_offset(problems: int) -> int:
    """Where the adaptive tile's int32 choice sits in the workspace: after the problem arrays
    and the second kernel's shapes (kernels/grouped_gemm.cuh, adaptive_bytes)."""
    return (_round256(_GROUP_ARRAY_BYTES_PER_GROUP * problems) + _round256(_SHAPE_BYTES * problems))


def workspace_bytes(problems: int, tile: int = 0) -> int:
    """Bytes of the workspace output buffer of one FFI call with `problems` CUTLASS problems
    (`num_problems`); the adaptive tile adds the second kernel's shapes, its choice and its
    CUTLASS workspace."""
    if tile in ADAPTIVE_TILES:
        return _choice_offset(problems) + 256 + 2 * _CUTLASS_WORKSPACE_BYTES
    return _round256(_GROUP_ARRAY_BYTES_PER_GROUP * problems) + _CUTLASS_WORKSPACE_BYTES


def adaptive_choice(workspace, problems: int):
    """From the workspace of an adaptive-tile call with `problems` CUTLASS problems
    (`num_problems`): int32 1 where the device chose the second tile (pingpong_64x256), 0 for
    the first (coop_128x256). For tests and benchmarks."""
    off = _choice_offset(problems)
    return jax.lax.bitcast_convert_type(workspace[off:off + 4].reshape(1, 4), jnp.int32)[0]


def parse_split(text: str) -> int | None:
    """'rROWS' -> ROWS (0 or a multiple of SPLIT_ROWS_MULTIPLE); None if `text` is not one."""
    ok = len(text) > 1 and text[0] == "r" and text[1:].isdigit()
    return int(text[1:]) if ok and int(text[1:]) % SPLIT_ROWS_MULTIPLE == 0 else None


def parse_config(name: str) -> tuple[int, int, int, int]:
    """'TILE[/RASTER[/sSWIZZLE[/rROWS]]]' -> (tile index, raster index, swizzle, split rows).

    TILE from TILE_CONFIGS, RASTER from RASTERS (default along_m), SWIZZLE from SWIZZLES
    (default 1), ROWS the row split (default 0: none; else a multiple of SPLIT_ROWS_MULTIPLE);
    e.g. 'coop_256x128_c2x1/along_n/s2', 'coop_128x256_c2x1/along_m/s1/r2048'.
    """
    parts = str(name).split("/")
    ok = 1 <= len(parts) <= 4 and parts[0] in TILE_CONFIGS
    raster = parts[1] if len(parts) > 1 else RASTERS[0]
    swz = parts[2] if len(parts) > 2 else "s1"
    split = parse_split(parts[3] if len(parts) > 3 else "r0")
    ok = ok and raster in RASTERS and swz in tuple(f"s{v}" for v in SWIZZLES) and split is not None
    if not ok:
        raise ValueError(f"grouped GEMM config {name!r} is invalid; valid: "
                         f"TILE[/RASTER[/sN[/rROWS]]] with TILE in {TILE_CONFIGS}, RASTER in "
                         f"{RASTERS}, N in {SWIZZLES}, ROWS 0 or a multiple of "
                         f"{SPLIT_ROWS_MULTIPLE}")
    return TILE_CONFIGS.index(parts[0]), RASTERS.index(raster), int(swz[1:]), split


def config_name(tile: int, raster: int = 0, swizzle: int = 1, split_rows: int = 0) -> str:
    """Inverse of parse_config (the full form; `/rROWS` only with a row split)."""
    name = f"{TILE_CONFIGS[tile]}/{RASTERS[raster]}/s{swizzle}"
    return name + (f"/r{split_rows}" if split_rows else "")


def choose_config(op: str, m: int, k: int, n: int, num_groups: int) -> str:
    """Kernel configuration (parse_config form) for one GEMM: the rule of docs/grouped_gemm.md.

    op: 'fwd' ([M,K] x [E,K,N]), 'dgrad' ([M,N] x [E,K,N]^T), 'wgrad' ([M,K]^T x [M,N] per
    group). m, k, n, num_groups: the shapes of the *forward* problem. The environment variable
    MOE_PRAXIS_GG_TILE (a parse_config string) overrides the rule.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid; valid: {OPS}")
    forced = os.environ.get(ENV_TILE)
    if forced:
        try:
            return config_name(*parse_config(forced))
        except ValueError as e:
            raise ValueError(f"${ENV_TILE}={forced!r} is invalid: {e}") from None
    rows_per_group = m / max(num_groups, 1)
    # Per group, the GEMM's output is out_rows x out_cols (wgrad: K x N, the same for every
    # group; fwd/dgrad: the group's rows x N or K).
    out_rows, out_cols = {
        "fwd": (rows_per_group, n),
        "dgrad": (rows_per_group, k),
        "wgrad": (k, n)
    }[op]
    if op == "wgrad" and rows_per_group < 2048:
        tile = 1  # short mainloops (the group's rows): ping-pong 128x128 hides the epilogue
    elif op != "wgrad" and rows_per_group <= 256:
        # tiny groups: ragged group ends waste a large share of 128-row tiles; the device picks
        # 128x256 or 64x256 at each call from the actual group sizes (docs/grouped_gemm.md)
        tile = TILE_CONFIGS.index("adaptive_128x256_64x256_c1x1")
    elif op != "wgrad" and rows_per_group <= 2048:
        # small groups: 1x1 clusters round no group's tile grid up to whole clusters; measured
        # as fast as or faster than the adaptive pair (which costs a second launch) at B and C
        tile = TILE_CONFIGS.index("coop_128x256_c1x1")
    else:
        tile = 2  # coop_128x256_c2x1
    # Raster: hand out tiles so that consecutive CTAs share the larger operand tile.
    raster = 1 if out_rows >= out_cols else 0
    swizzle = 1  # the only value CUTLASS's group scheduler uses here (docs/grouped_gemm.md)
    return config_name(tile, raster, swizzle)


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


def call_kernel(target: str, results, *args, num_groups: int, config: str, tiles=None, **attrs):
    """One grouped GEMM FFI call: `results` (ShapeDtypeStructs) plus the workspace sized for
    `num_groups` groups (and the row split's pieces of the first argument's rows) and the
    configuration's tile, with the configuration's tile / raster / swizzle / split_rows
    attributes and `attrs`. tiles: the tiles `target` is built for (None: all).
    Returns the results, then the workspace."""
    tile, raster, swizzle, split_rows = parse_config(config)
    if tiles is not None and tile not in tiles:
        raise ValueError(f"{target}: config {config!r}: tile {TILE_CONFIGS[tile]!r} is not "
                         f"built; valid: {[TILE_CONFIGS[t] for t in tiles]}")
    if target == _TARGETS["wgrad"]:
        split_rows = 0  # wgrad's rows are its contraction: never split (the kernel ignores it)
    problems = num_problems(num_groups, args[0].shape[0], split_rows)
    ws = jax.ShapeDtypeStruct((workspace_bytes(problems, tile), ), jnp.uint8)
    return _cuda.ffi(target,
                     tuple(results) + (ws, ),
                     *args,
                     tile=tile,
                     raster=raster,
                     swizzle=swizzle,
                     split_rows=split_rows,
                     **attrs)


def _ffi(op: str, out_shape, a, b, group_sizes, config: str, with_workspace: bool = False):
    out, workspace = call_kernel(_TARGETS[op], (jax.ShapeDtypeStruct(out_shape, a.dtype), ),
                                 a,
                                 b,
                                 group_sizes.astype(jnp.int32),
                                 num_groups=group_sizes.shape[0],
                                 config=config)
    return (out, workspace) if with_workspace else out


def cuda_fwd(lhs, rhs, group_sizes, config: str):
    """CUDA forward: lhs [M,K] bf16, rhs [E,K,N] bf16 -> [M,N] bf16 (no fallback, no vjp)."""
    return _ffi("fwd", (lhs.shape[0], rhs.shape[2]), lhs, rhs, group_sizes, config)


def cuda_dgrad(dout, rhs, group_sizes, config: str):
    """CUDA dgrad: dout [M,N] bf16, rhs [E,K,N] bf16 -> dlhs [M,K] bf16."""
    return _ffi("dgrad", (dout.shape[0], rhs.shape[1]), dout, rhs, group_sizes, config)


def cuda_wgrad(lhs, dout, group_sizes, config: str):
    """CUDA wgrad: lhs [M,K] bf16, dout [M,N] bf16 -> drhs [E,K,N] bf16."""
    return _ffi("wgrad", (group_sizes.shape[0], lhs.shape[1], dout.shape[1]), lhs, dout,
                group_sizes, config)


def cuda_unsupported_reason(lhs, rhs) -> str | None:
    """Why the CUDA kernels cannot run this problem (None if they can; device not checked)."""
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16:
        return f"the CUDA grouped GEMM takes bf16 lhs and rhs, got {lhs.dtype} and {rhs.dtype}"
    k, n = rhs.shape[1], rhs.shape[2]
    if k % 8 or n % 8:
        return f"the CUDA grouped GEMM needs K and N multiples of 8, got K={k}, N={n}"
    return None


def _device_reason() -> str | None:
    """Why this host's GPUs cannot run sm_90a code (None if they can)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no GPU visible to JAX"
    ccs = {str(getattr(d, "compute_capability", "")) for d in gpus}
    bad = sorted(c for c in ccs if c.split(".")[0] != "9")
    if bad:
        return (f"the CUDA grouped GEMM is sm_90a code (compute capability 9.0); the GPU "
                f"{gpus[0].device_kind!r} has {', '.join(bad)}")
    return None


_warned: set[str] = set()


def _resolve(backend: str, lhs, rhs) -> str:
    """'xla' or 'cuda' for this call.

    'cuda' where the device cannot run the kernels (no GPU, library not built, compute
    capability not 9.0) raises an error that says why. A problem the kernels do not take
    (dtype other than bf16, K or N not a multiple of 8) runs the XLA reference under 'auto'
    and 'cuda' alike, with a warning (once per reason) naming the reason: moe_block passes its
    resolved backend to every op, so a float32 model on a Hopper GPU must still run.
    """
    resolved = _backend.resolve_backend(backend, "grouped_gemm")
    if resolved == "xla":
        return "xla"
    why = _device_reason()
    if why is not None:
        if backend == "cuda":
            raise RuntimeError(f"kernel_backend='cuda' requested for grouped_gemm but {why}")
        return "xla"
    why = cuda_unsupported_reason(lhs, rhs)
    if why is None:
        return "cuda"
    if why not in _warned:
        _warned.add(why)
        warnings.warn(
            f"grouped_gemm: {why}; running the XLA reference (jax.lax.ragged_dot) "
            "instead",
            stacklevel=3)
    return "xla"


# ----------------------------------------------------------------------- custom_vjp op


def _empty(m, k, n, e) -> bool:
    """Problems with a zero-sized dimension: computed by the reference (all zeros)."""
    return 0 in (m, k, n, e)


def _run(op, dims, reference, cuda_fn, a, b, group_sizes, impl):
    """One of the three GEMMs: the reference for impl 'xla' or an empty problem, else the CUDA
    kernel (configuration: impl's, or choose_config's for the forward dims (m, k, n, e))."""
    if impl[0] == "xla" or _empty(*dims):
        return reference(a, b, group_sizes)
    cfg = impl[1] if impl[1] is not None else choose_config(op, *dims)
    return _cuda.platform_call(lambda x, y, g: cuda_fn(x, y, g, cfg), reference, a, b, group_sizes)


def _fwd_impl(lhs, rhs, group_sizes, impl):
    (m, k), (e, _, n) = lhs.shape, rhs.shape
    return _run("fwd", (m, k, n, e),
                lambda a, b, g: grouped_gemm_reference(a, b, g).astype(a.dtype), cuda_fwd, lhs, rhs,
                group_sizes, impl)


def _dgrad_impl(dout, rhs, group_sizes, impl):
    (m, n), (e, k, _) = dout.shape, rhs.shape
    return _run("dgrad", (m, k, n, e),
                lambda a, b, g: grouped_gemm_dgrad_reference(a, b, g).astype(a.dtype), cuda_dgrad,
                dout, rhs, group_sizes, impl)


def _wgrad_impl(lhs, dout, group_sizes, impl):
    (m, k), n, e = lhs.shape, dout.shape[1], group_sizes.shape[0]
    return _run("wgrad", (m, k, n, e), grouped_gemm_wgrad_reference, cuda_wgrad, lhs, dout,
                group_sizes, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _grouped_gemm(lhs, rhs, group_sizes, impl):
    return _fwd_impl(lhs, rhs, group_sizes, impl)


def _vjp_fwd(lhs, rhs, group_sizes, impl):
    return _fwd_impl(lhs, rhs, group_sizes, impl), (lhs, rhs, group_sizes)


def _vjp_bwd(impl, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = _dgrad_impl(dout, rhs, group_sizes, impl)
    drhs = _wgrad_impl(lhs, dout, group_sizes, impl).astype(rhs.dtype)
    return dlhs, drhs, _cuda.zero_cotangent(group_sizes)


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
        config = config_name(*parse_config(config))
    resolved = _resolve(backend, lhs, rhs)
    impl = (resolved, config)
    return _grouped_gemm(lhs, rhs, group_sizes.astype(jnp.int32), impl)
