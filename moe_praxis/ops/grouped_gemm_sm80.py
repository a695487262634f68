"""The sm_80 grouped GEMM kernels: their tiles, workspace, the rule that picks a tile, the calls.

kernels/grouped_gemm_sm80_{fwd,dgrad,wgrad}.cu: CUTLASS 2.x `GemmGrouped` (tensor-core
mma.sync, cp.async multistage mainloop), bf16 or fp16 in, fp32 accumulate, out in the input
type, compiled for sm_80 plus compute_80 PTX: they run on every CUDA GPU from Ampere on (the
Hopper kernels of ops.grouped_gemm_tiles, sm_90a code, on 9.0 only). The same contract as the Hopper
kernels: ragged_dot semantics, group sizes read on the device by a prepare kernel (no host
copy, no sync; CUDA-graph safe), rows past the sum zeroed, wgrad of empty experts zero. Which
family runs: ops.backend.grouped_gemm_kernel (MOE_PRAXIS_GROUPED_GEMM=sm80 forces this one).

A configuration is one compiled tile, named 'sm80_<M>x<N>x<K>_s<stages>' (SM80_TILE_CONFIGS;
its index is the handlers' `tile` attribute). `choose_sm80_config` is the rule
(docs/grouped_gemm_sm80.md); MOE_PRAXIS_GG_TILE or the `config=` argument of grouped_gemm
force one (an sm_80 name there while the Hopper kernels run, or a Hopper name while these run,
is an error naming the valid ones).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from moe_praxis.ops._library import ffi
from moe_praxis.ops.grouped_gemm_tiles import ENV_TILE, GROUP_ARRAY_BYTES_PER_GROUP, OPS

# FFI target of each of the three GEMMs
SM80_TARGETS = {
    "fwd": "moe_grouped_gemm_sm80_fwd",
    "dgrad": "moe_grouped_gemm_sm80_dgrad",
    "wgrad": "moe_grouped_gemm_sm80_wgrad",
}
# Compiled tiles (index = the `tile` attribute; kernels/grouped_gemm_sm80.cuh, dispatch_tile):
# threadblock M x N x K, pipeline stages.
SM80_TILE_CONFIGS = (
    "sm80_128x256x64_s3",  # 0: 8 warps of 64x64; the most reuse per byte (large outputs)
    "sm80_128x128x32_s4",  # 1: 4 warps of 64x64; the general tile
    "sm80_64x128x32_s4",  # 2: 4 warps of 32x64; small groups (a ragged end wastes < 64 rows)
    "sm80_128x64x32_s4",  # 3: 4 warps of 64x32; few output tiles (more, smaller tiles)
    "sm80_256x128x64_s3",  # 4: 8 warps of 64x64; 0 transposed (tall outputs)
    "sm80_256x128x32_s4",  # 5: 8 warps of 64x64, 96 KiB (fits sm_86 / sm_89)
    "sm80_128x256x32_s4",  # 6: 8 warps of 64x64, 96 KiB (fits sm_86 / sm_89)
    "sm80_128x128x64_s3",  # 7: 4 warps of 64x64; half the barriers per FLOP of tile 1
    "sm80_128x128x32_s5",  # 8: 4 warps of 64x64; one more stage in flight than tile 1
    "sm80_64x256x32_s4",  # 9: 4 warps of 64x64; small groups with wide outputs
)
SM80_DTYPES = (jnp.bfloat16, jnp.float16)
# The SM count the rule assumes (an A100's; the rule counts waves of output tiles with it).
RULE_SM_COUNT = 108


def sm80_shared_memory(config: str) -> int:
    """Shared memory (bytes) one block of `config` needs: its mainloop's stages of the A and B
    tiles (16-bit elements; the epilogue reuses that memory)."""
    tm, tn, tk, stages = sm80_tile_shape(config)
    return (tm * tk + tk * tn) * 2 * stages


def is_sm80_config(name: str) -> bool:
    """Whether `name` names an sm_80 configuration (the 'sm80_' prefix)."""
    return str(name).startswith("sm80_")


def parse_sm80_config(name: str) -> int:
    """'sm80_128x128x32_s4' -> its tile index; ValueError naming the valid ones."""
    if name not in SM80_TILE_CONFIGS:
        raise ValueError(f"sm_80 grouped GEMM config {name!r} is invalid; valid: "
                         f"{SM80_TILE_CONFIGS}")
    return SM80_TILE_CONFIGS.index(name)


def sm80_tile_shape(config: str) -> tuple[int, int, int, int]:
    """(tile M, tile N, tile K, stages) of an sm_80 configuration."""
    dims, stages = config[len("sm80_"):].split("_s")
    tm, tn, tk = (int(v) for v in dims.split("x"))
    return tm, tn, tk, int(stages)


def sm80_workspace_bytes(num_groups: int) -> int:
    """Bytes of the workspace output of one call: the per-group arrays (problem size, three
    pointers, three leading dimensions; GROUP_ARRAY_BYTES_PER_GROUP a group) rounded up to 256.
    GemmGrouped reading its problems on the device needs no workspace of its own."""
    return (GROUP_ARRAY_BYTES_PER_GROUP * num_groups + 255) // 256 * 256


# The sweep's per-shape winners (`python -m benchmarks.bench_grouped_gemm --sm80 --sm80-tiles
# all`, balanced groups, one H200 running the sm_80 code; benchmarks/results/
# grouped_gemm_sm80_sweep.json, docs/grouped_gemm_sm80.md): per op, the measured forward shapes
# (E, M, K, N) with every tile, fastest first. The benchmark prints this table ready to paste
# (`sm80_sweep.winners_literal`).
SM80_MEASURED: dict[str, tuple[tuple[tuple[int, int, int, int], tuple[str, ...]], ...]] = {
    "fwd": (
        ((8, 32768, 4096, 14336), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_128x128x32_s4",
            "sm80_128x128x32_s5",
            "sm80_256x128x64_s3",
            "sm80_128x128x64_s3",
            "sm80_128x256x64_s3",
            "sm80_64x256x32_s4",
            "sm80_64x128x32_s4",
            "sm80_128x64x32_s4",
        )),
        ((32, 32768, 7168, 2048), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_128x128x32_s5",
            "sm80_128x128x32_s4",
            "sm80_256x128x64_s3",
            "sm80_128x128x64_s3",
            "sm80_64x256x32_s4",
            "sm80_128x256x64_s3",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
        ((128, 65536, 2048, 768), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_128x128x32_s5",
            "sm80_256x128x64_s3",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s4",
            "sm80_64x256x32_s4",
            "sm80_128x256x64_s3",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
    ),
    "dgrad": (
        ((8, 32768, 4096, 14336), (
            "sm80_256x128x32_s4",
            "sm80_128x256x32_s4",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s5",
            "sm80_256x128x64_s3",
            "sm80_128x128x32_s4",
            "sm80_128x256x64_s3",
            "sm80_64x256x32_s4",
            "sm80_64x128x32_s4",
            "sm80_128x64x32_s4",
        )),
        ((32, 32768, 7168, 2048), (
            "sm80_256x128x32_s4",
            "sm80_128x256x32_s4",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s4",
            "sm80_256x128x64_s3",
            "sm80_128x128x32_s5",
            "sm80_128x256x64_s3",
            "sm80_64x256x32_s4",
            "sm80_64x128x32_s4",
            "sm80_128x64x32_s4",
        )),
        ((128, 65536, 2048, 768), (
            "sm80_256x128x32_s4",
            "sm80_128x256x32_s4",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s5",
            "sm80_256x128x64_s3",
            "sm80_128x128x32_s4",
            "sm80_128x256x64_s3",
            "sm80_64x256x32_s4",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
    ),
    "wgrad": (
        ((8, 32768, 4096, 14336), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_256x128x64_s3",
            "sm80_128x256x64_s3",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s4",
            "sm80_128x128x32_s5",
            "sm80_64x256x32_s4",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
        ((32, 32768, 7168, 2048), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_256x128x64_s3",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s5",
            "sm80_64x256x32_s4",
            "sm80_128x128x32_s4",
            "sm80_128x256x64_s3",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
        ((128, 65536, 2048, 768), (
            "sm80_128x256x32_s4",
            "sm80_256x128x32_s4",
            "sm80_128x128x64_s3",
            "sm80_128x128x32_s5",
            "sm80_256x128x64_s3",
            "sm80_64x256x32_s4",
            "sm80_128x128x32_s4",
            "sm80_128x256x64_s3",
            "sm80_128x64x32_s4",
            "sm80_64x128x32_s4",
        )),
    ),
}
# A measured shape speaks for problems within this factor of it in every per-group dimension
# (output rows, output columns, contraction); outside, the wave-count rule below decides.
MEASURED_REACH = 4.0


def sm80_problem(op: str, m: int, k: int, n: int, num_groups: int) -> tuple[float, int, float]:
    """(output rows, output columns, contraction) of one group of `op` for the forward shapes:
    fwd (M/E, N, K), dgrad (M/E, K, N), wgrad (K, N, M/E)."""
    rows = m / max(num_groups, 1)
    return {"fwd": (rows, n, k), "dgrad": (rows, k, n), "wgrad": (k, n, rows)}[op]


def measured_ranking(op: str, m: int, k: int, n: int, num_groups: int) -> tuple[str, ...] | None:
    """The tiles of the nearest shape of SM80_MEASURED[op] (fastest first), or None where no
    measured shape is within MEASURED_REACH of this one in every per-group dimension. Nearness:
    the largest |log ratio| over the dimensions."""
    here = sm80_problem(op, m, k, n, num_groups)
    best = None
    for shape, ranking in SM80_MEASURED.get(op, ()):
        there = sm80_problem(op, shape[1], shape[2], shape[3], shape[0])
        dist = max(abs(math.log(max(a, 1) / max(b, 1))) for a, b in zip(here, there))
        if dist <= math.log(MEASURED_REACH) and (best is None or dist < best[0]):
            best = (dist, ranking)
    return None if best is None else best[1]


def _waves(m_rows: float, out_cols: int, num_groups: int, tm: int, tn: int) -> float:
    """Waves of output tiles on RULE_SM_COUNT SMs, one resident tile per SM, groups of m_rows
    rows with out_cols columns."""
    return num_groups * math.ceil(m_rows / tm) * math.ceil(out_cols / tn) / RULE_SM_COUNT


def choose_sm80_config(op: str,
                       m: int,
                       k: int,
                       n: int,
                       num_groups: int,
                       shared_memory: int | None = None) -> str:
    """The sm_80 tile for one GEMM (docs/grouped_gemm_sm80.md, "The rule").

    op: 'fwd' | 'dgrad' | 'wgrad'; m, k, n, num_groups: the *forward* problem's shapes;
    shared_memory: the bytes a block may have on the GPU (None: no limit; sm_86 / sm_89 GPUs
    have 99 KiB, the A100 163 KiB, Hopper 227 KiB): a tile that needs more is never chosen.
    Per group the output is out_rows x out_cols (fwd: M/E x N, dgrad: M/E x K, wgrad: K x N):
      - fwd/dgrad with at most 128 rows per group: 64x128 (a 128-row tile would be half empty
        at every group's ragged end);
      - near a measured shape (SM80_MEASURED, within MEASURED_REACH): its fastest tile that fits;
      - 128x256 where it still makes at least 4 waves of tiles and out_cols >= 256 (the most
        reuse of each operand byte; enough tiles that the last wave's tail is small), and its
        shared memory fits;
      - else 128x128 where it makes at least 2 waves;
      - else 128x64 (more, smaller tiles to fill the GPU).
    MOE_PRAXIS_GG_TILE (an sm_80 configuration) overrides the rule.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is invalid; valid: {OPS}")
    forced = os.environ.get(ENV_TILE)
    if forced:
        try:
            return SM80_TILE_CONFIGS[parse_sm80_config(forced)]
        except ValueError as e:
            raise ValueError(f"${ENV_TILE}={forced!r} is invalid while the sm_80 grouped GEMM "
                             f"kernels run: {e}") from None

    def fits(config):
        return shared_memory is None or sm80_shared_memory(config) <= shared_memory

    out_rows, out_cols, _ = sm80_problem(op, m, k, n, num_groups)
    groups = min(num_groups, m) if op == "wgrad" else num_groups
    if op != "wgrad" and out_rows <= 128:
        return SM80_TILE_CONFIGS[2]
    for config in measured_ranking(op, m, k, n, num_groups) or ():
        if fits(config):
            return config
    if (fits(SM80_TILE_CONFIGS[0]) and out_cols >= 256
            and _waves(out_rows, out_cols, groups, 128, 256) >= 4):
        return SM80_TILE_CONFIGS[0]
    if _waves(out_rows, out_cols, groups, 128, 128) >= 2:
        return SM80_TILE_CONFIGS[1]
    return SM80_TILE_CONFIGS[3]


def sm80_unsupported_reason(lhs, rhs) -> str | None:
    """Why the sm_80 kernels cannot run this problem (None if they can; device not checked)."""
    if lhs.dtype != rhs.dtype or lhs.dtype not in SM80_DTYPES:
        return (f"the CUDA grouped GEMM (sm80 kernels) takes bf16 lhs and rhs (or fp16 both), got "
                f"{lhs.dtype} and {rhs.dtype}")
    k, n = rhs.shape[1], rhs.shape[2]
    if k % 8 or n % 8:
        return f"the CUDA grouped GEMM needs K and N multiples of 8, got K={k}, N={n}"
    return None


def run_sm80_kernel(op: str, out_shape, a, b, group_sizes, config: str):
    """One of the three GEMMs ('fwd' | 'dgrad' | 'wgrad') as its sm_80 FFI call with `config`:
    the [out_shape] result in a.dtype. No fallback, no vjp."""
    tile = parse_sm80_config(config)
    ws = jax.ShapeDtypeStruct((sm80_workspace_bytes(group_sizes.shape[0]), ), jnp.uint8)
    out, _ = ffi(SM80_TARGETS[op], (jax.ShapeDtypeStruct(out_shape, a.dtype), ws),
                 a,
                 b,
                 group_sizes.astype(jnp.int32),
                 tile=tile)
    return out
