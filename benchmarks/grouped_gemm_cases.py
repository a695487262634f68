"""What `python -m benchmarks.bench_grouped_gemm` times: the shapes A, B, C, the group size
distributions, the configurations swept (ours: SWEEP, `--configs` entries through
expand_config; Pallas: PALLAS_CONFIGS; sm_80: parse_sm80_tiles), the CTA tiles a configuration
issues (issued_tiles), and the jitted functions of each method, all called as
f(lhs, rhs, dout, group_sizes). The module doc of benchmarks/bench_grouped_gemm.py describes
the methods; bench_fp8 and bench_gate_up time the same shapes and group sizes."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np

# The module (the attribute ops.grouped_gemm is the function).
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")

SHAPES = {  # name: (E, M, K, N)
    "A": (8, 32768, 4096, 14336),
    "B": (32, 32768, 7168, 2048),
    "C": (128, 65536, 2048, 768),
    # A at 4x the rows (the Mixtral-like layer at T=65536: 16384 rows per group), where neither
    # a group's row block nor its weight fits the L2 (not in the default sweep)
    "A4": (8, 131072, 4096, 14336),
    # its down projection (K=14336, N=4096): the dgrad writes the 14336 wide rows
    "A4t": (8, 131072, 14336, 4096),
    # A's down projection (the Mixtral-like layer at T=16384)
    "At": (8, 32768, 14336, 4096),
    # the Qwen3-like layer's gate/up at T=16384 (1024 rows per group)
    "C2": (128, 131072, 2048, 768),
}
DISTS = ("balanced", "skewed")
OPS = ("fwd", "dgrad", "wgrad")
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
PALLAS_CONFIGS = {
    "fwd": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (64, 256, 64, 4, 1)],
    "wgrad": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8)],
}
PALLAS_CONFIGS["dgrad"] = PALLAS_CONFIGS["fwd"]
# Our configurations timed at every point (the chosen one is timed too if not among them).
# (Swizzles 2, 4, 8 run the same kernel as 1 here: docs/grouped_gemm.md, "Raster and swizzle".)
SWEEP = [
    gg.config_name(2, 0),
    gg.config_name(2, 1),
    gg.config_name(1, 1),
    gg.config_name(1, 0),
    gg.config_name(0, 1),
    gg.config_name(3, 0),
    gg.config_name(3, 1),
    gg.config_name(4, 0),  # the adaptive pairs with 2x1 and 1x1 clusters, and their tiles
    gg.config_name(10, 0),
    gg.config_name(8, 0),
    gg.config_name(9, 0),
    gg.config_name(11, 0),  # ping-pong 128x192 with 1x1 and 2x1 clusters
    gg.config_name(12, 0),
]


def expand_config(token: str, chosen: str) -> str:
    """A --configs entry -> a configuration: `rule[/RASTER][/rROWS]` is `chosen` with those
    parts replaced; anything else is a grouped_gemm.parse_config string."""
    parts = token.split("/")
    if parts[0] != "rule":
        return gg.config_name(*gg.parse_config(token))
    tile, raster, swizzle, split = gg.parse_config(chosen)
    for part in parts[1:]:
        if part in gg.RASTERS:
            raster = gg.RASTERS.index(part)
        elif gg.parse_split(part) is not None:
            split = gg.parse_split(part)
        else:
            raise ValueError(f"--configs entry {token!r}: part {part!r} is invalid; valid: "
                             f"a raster {gg.RASTERS} or rROWS (ROWS 0 or a multiple of "
                             f"{gg.SPLIT_ROWS_MULTIPLE})")
    return gg.config_name(tile, raster, swizzle, split)


def group_sizes(dist: str, m: int, e: int) -> np.ndarray:
    """balanced: M/E each; skewed: Zipf(1.2) shares in a fixed shuffled order, summing to M."""
    if dist == "balanced":
        s = np.full(e, m // e)
        s[:m - s.sum()] += 1
    else:
        w = 1.0 / np.arange(1, e + 1)**1.2
        w = np.random.default_rng(0).permutation(w)
        s = np.floor(w / w.sum() * m).astype(np.int64)
        s[np.argmax(s)] += m - s.sum()
    return s.astype(np.int32)


def _ceil_div(x: int, q: int) -> int:
    return -(-int(x) // q)


def issued_tiles(config: str, op: str, sizes, k: int, n: int) -> int | None:
    """CTA tiles that CUTLASS's group scheduler issues for `config` (each group's tile grid
    rounded up to whole clusters, gg.CLUSTERS, as kernels/grouped_gemm.cuh counts them); None
    for the adaptive pairs (the device picks their tile at each call)."""
    tile = gg.parse_config(config)[0]
    m = re.match(r"(?:coop|pingpong)_(\d+)x(\d+)_", gg.TILE_CONFIGS[tile])
    if m is None:
        return None
    tm, tn = (int(v) for v in m.groups())
    cm, cn = gg.CLUSTERS[tile]
    rows_cols = {
        "fwd": [(s, n) for s in sizes],
        "dgrad": [(s, k) for s in sizes],
        "wgrad": [(k, n) for s in sizes if s > 0],
    }[op]
    return sum(
        _ceil_div(_ceil_div(r, tm), cm) * cm * _ceil_div(_ceil_div(c, tn), cn) * cn
        for r, c in rows_cols if r > 0)


def dense_fns():
    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(lhs, rhs[0])),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(dout, rhs[0].T)),
        "wgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.dot(lhs.T, dout)),
    }


def batched_fns(e: int):
    """The balanced problem as one batched cuBLAS GEMM (every group M/E rows): the same
    FLOPs and the same E weight matrices as ours, so the same weight traffic, which the dense
    GEMM (one [K, N] weight) does not have. Only for balanced groups with E dividing M."""

    def rows(x):
        return x.reshape(e, x.shape[0] // e, x.shape[1])

    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emk,ekn->emn", rows(lhs), rhs)),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emn,ekn->emk", rows(dout), rhs)),
        "wgrad":
        jax.jit(lambda lhs, rhs, dout, gs: jnp.einsum("emk,emn->ekn", rows(lhs), rows(dout))),
    }


def ragged_fns():
    return {
        "fwd": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_reference(lhs, rhs, gs)),
        "dgrad": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_dgrad_reference(dout, rhs, gs)),
        "wgrad": jax.jit(lambda lhs, rhs, dout, gs: gg.grouped_gemm_wgrad_reference(lhs, dout, gs)),
    }


def ours_fn(op: str, config: str):
    f = {
        "fwd": lambda lhs, rhs, dout, gs: gg.cuda_fwd(lhs, rhs, gs, config),
        "dgrad": lambda lhs, rhs, dout, gs: gg.cuda_dgrad(dout, rhs, gs, config),
        "wgrad": lambda lhs, rhs, dout, gs: gg.cuda_wgrad(lhs, dout, gs, config)
    }[op]
    return jax.jit(f)


def sm80_fn(op: str, config: str):
    """The sm_80 kernel of `op` with `config` (an SM80_TILE_CONFIGS name), jitted."""
    f = {
        "fwd":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("fwd", (lhs.shape[0], rhs.shape[2]), lhs, rhs,
                                                      gs, config),
        "dgrad":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("dgrad", (dout.shape[0], rhs.shape[1]), dout,
                                                      rhs, gs, config),
        "wgrad":
        lambda lhs, rhs, dout, gs: gg.run_sm80_kernel("wgrad", rhs.shape, lhs, dout, gs, config),
    }[op]
    return jax.jit(f)


def pallas_fn(op: str, cfg):
    bm, bn, bk, steps, gbn = cfg
    kw = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)
    if op == "wgrad":
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t

        return jax.jit(
            lambda lhs, rhs, dout, gs: t.transposed_ragged_dot(lhs, dout, group_sizes=gs, **kw))
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as r

    if op == "fwd":
        return jax.jit(lambda lhs, rhs, dout, gs: r.ragged_dot(lhs, rhs, group_sizes=gs, **kw))
    return jax.jit(lambda lhs, rhs, dout, gs: r.ragged_dot(
        dout, rhs, group_sizes=gs, transpose_rhs=True, **kw))


def parse_sm80_tiles(text: str):
    """--sm80-tiles: 'all' -> every SM80_TILE_CONFIGS name, 'rule' -> 'rule', else the
    comma-separated configurations (ValueError naming the valid ones)."""
    if text == "rule":
        return "rule"
    if text == "all":
        return list(gg.SM80_TILE_CONFIGS)
    return [gg.SM80_TILE_CONFIGS[gg.parse_sm80_config(c)] for c in text.split(",") if c]


def sm80_one_group_fn(op: str, config: str):
    """The sm_80 kernel of `op` with `config` on ONE group of all the rows against expert 0's
    weight: the FLOPs of the dense GEMM through the same tile and code (mma.sync), so the gap
    from it to the grouped call is what the grouping costs, and the gap from it to dense cuBLAS
    what the Ampere instructions cost on this GPU. (The slice of the weight is a copy of one
    expert's weight inside the call, well under 1% of these GEMMs' time.)"""
    base = sm80_fn(op, config)

    def f(lhs, rhs, dout, gs):
        del gs
        return base(lhs, rhs[:1], dout, jnp.full((1, ), lhs.shape[0], jnp.int32))

    return jax.jit(f)
