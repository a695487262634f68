"""A model of the expert-parallel token exchange of a DeepSeek-V3-like layer at 64 to 1024 GPUs. Runs on the CPU; nothing is timed:

    python -m benchmarks.ep_model [--tokens-per-gpu 8192] [--compute-ms 39.8] [--json FILE]

Routing statistics come from moe_praxis's own router (the pure-JAX reference) with DeepSeek-V3's
routing (sigmoid scores, 8 expert groups, top-4 groups, top-8 experts, E = 256) on random tokens
and a random router: which GPUs and nodes each token's copies land on, for experts placed
contiguously (E / ep per GPU, 8 GPUs per node). A random router spreads load about evenly; a
trained one is less even, so the busiest GPU's receive share is printed and used too.

Bytes per GPU per training step: four transfers of the routed rows (forward dispatch and
combine; backward the gradients of both), M = 7168 columns. Three designs:
  per-copy bf16   every (token, expert) copy is a bf16 row (moe_praxis's exchange today);
  per-GPU bf16    a token goes once to each GPU holding any of its experts; the copies'
                  outputs are summed there before the return trip;
  DeepSeek-V3     once per destination NODE over InfiniBand, then fanned out over NVLink
                  (DeepEP); forward dispatch in FP8 (1 byte per element + one fp32 scale per
                  128), the other three transfers bf16.
Links (per GPU, one direction; state yours with the flags): NVLink inside a node at
--nvlink-gbs (default 200 GB/s: what jax.lax.all_to_all reached on 2 H200s,
benchmarks/results/ep_exchange.md; NVLink 4's spec is 450 GB/s), InfiniBand between nodes
at --ib-gbs (default 40 GB/s: a 400 Gb/s NDR NIC per GPU is 50 GB/s, about 80% of it is
usual for all-to-all traffic). The two run concurrently: a transfer takes
max(NVLink bytes / NVLink rate, IB bytes / IB rate).
Compute: --compute-ms, the layer's fwd+bwd time on one GPU at the same tokens per GPU (default
39.8 ms: the DeepSeek-V3-like row of the layer benchmark on one H200; the 9-GEMM
ideal is 22.0 ms). With per-GPU tokens fixed the expert FLOPs per GPU do not change with ep;
the busiest GPU computes its load share times that.
Printed per GPU count and ep: MB per GPU per step over each link, exchange ms, the overlap
needed (exchange / compute: the share of the compute the exchange must run under to be
hidden; above 1 it cannot be hidden), and the step's efficiency with no overlap and with full
overlap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis as mp
from moe_praxis import routing

E, K, M = 256, 8, 7168
GROUPS, GROUP_TOPK = 8, 4
GPUS_PER_NODE = 8
GPU_COUNTS = (64, 128, 256, 512, 1024)
TRANSFERS = 4  # forward dispatch, combine; backward: their gradients


def deepseek_config() -> mp.MoEConfig:
    return mp.MoEConfig(d_model=M,
                        d_ff=2048,
                        num_experts=E,
                        top_k=K,
                        score_func="sigmoid",
                        num_expert_groups=GROUPS,
                        group_topk=GROUP_TOPK,
                        use_expert_bias=True,
                        routed_scaling_factor=2.5)


def sample_expert_ids(num_tokens: int, seed: int = 0, router_dim: int = 256) -> np.ndarray:
    """[T, k] expert ids from the router on random tokens (logits ~ x @ w with unit variance;
    the width of x does not change their distribution, so a small one keeps this quick)."""
    cfg = deepseek_config()
    kx, kw = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(kw, (router_dim, E)) / math.sqrt(router_dim)
    route = jax.jit(lambda x: routing.route_logits_reference(x @ w, cfg, jnp.zeros(E)).expert_ids)
    chunks = []
    for i, k in enumerate(jax.random.split(kx, max(1, num_tokens // 16384))):
        chunks.append(np.asarray(route(jax.random.normal(k, (min(16384, num_tokens), router_dim)))))
    return np.concatenate(chunks)[:num_tokens]


def exchange_stats(ids: np.ndarray, ep: int) -> dict:
    """Per-token destinations for source GPU 0 (node 0) with E/ep experts per GPU."""
    per_gpu = E // ep
    gpu = ids // per_gpu  # [T, k] destination GPU of each copy
    node = gpu // GPUS_PER_NODE
    t = ids.shape[0]
    remote = gpu != 0
    off_node = node != 0
    distinct_gpus = [np.unique(row) for row in gpu]
    distinct_nodes = [np.unique(row) for row in node]
    load = np.bincount(gpu.ravel(), minlength=ep)
    return {
        # per-copy rows
        "copy_nvlink": float(np.sum(remote & ~off_node)) / t,
        "copy_ib": float(np.sum(off_node)) / t,
        # one row per distinct destination GPU
        "gpu_nvlink":
        float(sum(np.sum((g != 0) & (g // GPUS_PER_NODE == 0)) for g in distinct_gpus)) / t,
        "gpu_ib": float(sum(np.sum(g // GPUS_PER_NODE != 0) for g in distinct_gpus)) / t,
        # one IB row per distinct remote node; inside each node, one NVLink row per distinct GPU
        # other than the receiving one (DeepEP forwards to the node's other GPUs)
        "node_ib": float(sum(np.sum(n != 0) for n in distinct_nodes)) / t,
        "node_nvlink":
        float(sum(len(g) - len(n) for g, n in zip(distinct_gpus, distinct_nodes))) / t,
        "max_nodes_per_token": int(max(len(n) for n in distinct_nodes)),
        "busiest_gpu_share": float(load.max() / load.mean()),
    }


def model(ids, gpus: str, ep: int, tokens: int, compute_ms: float, nvlink_gbs: float,
          ib_gbs: float) -> list[dict]:
    s = exchange_stats(ids, ep)
    row_bf16 = M * 2
    row_fp8 = M + 4 * (M // 128)
    designs = {
        "per-copy bf16": (s["copy_nvlink"], s["copy_ib"], row_bf16, row_bf16),
        "per-GPU bf16": (s["gpu_nvlink"], s["gpu_ib"], row_bf16, row_bf16),
        "DeepSeek-V3": (s["node_nvlink"], s["node_ib"], row_fp8, row_bf16),
    }
    compute = compute_ms * s["busiest_gpu_share"]
    out = []
    for name, (nv_rows, ib_rows, first_row, other_row) in designs.items():
        per_transfer = [first_row] + [other_row] * (TRANSFERS - 1)
        nv_bytes = sum(tokens * nv_rows * b for b in per_transfer)
        ib_bytes = sum(tokens * ib_rows * b for b in per_transfer)
        ms = sum(
            max(tokens * nv_rows * b / (nvlink_gbs * 1e9), tokens * ib_rows * b / (ib_gbs * 1e9))
            for b in per_transfer) * 1e3
        out.append({
            "gpus": gpus,
            "ep": ep,
            "design": name,
            "nvlink_mb": nv_bytes / 1e6,
            "ib_mb": ib_bytes / 1e6,
            "exchange_ms": ms,
            "compute_ms": compute,
            "overlap_needed": ms / compute,
            "eff_no_overlap": compute_ms / (compute + ms),
            "eff_full_overlap": compute_ms / max(compute, ms),
            "busiest_gpu_share": s["busiest_gpu_share"],
            "max_nodes_per_token": s["max_nodes_per_token"],
        })
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--compute-ms", type=float, default=39.8)
    ap.add_argument("--nvlink-gbs", type=float, default=200.0)
    ap.add_argument("--ib-gbs", type=float, default=40.0)
    ap.add_argument("--sample-tokens", type=int, default=65536)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ids = sample_expert_ids(a.sample_tokens)
    rows = []
    # The exchange per GPU depends on ep only: data-parallel replicas (GPUs / ep of them) each
    # exchange among their own ep GPUs. ep <= E, so 512 and 1024 GPUs run ep 64..256 too.
    for ep in (64, 128, 256):
        gpus = ",".join(str(g) for g in GPU_COUNTS if g >= ep)
        rows += model(ids, gpus, ep, a.tokens_per_gpu, a.compute_ms, a.nvlink_gbs, a.ib_gbs)
    print(f"DeepSeek-V3-like layer (M={M}, E={E}, k={K}, {GROUPS} groups top-{GROUP_TOPK}), "
          f"{a.tokens_per_gpu} tokens per GPU, {GPUS_PER_NODE} GPUs per node; NVLink "
          f"{a.nvlink_gbs:g} GB/s, IB {a.ib_gbs:g} GB/s per GPU; compute {a.compute_ms:g} ms "
          f"fwd+bwd on one GPU\n")
    print("| GPUs (ep x dp) | ep | design | NVLink MB/step | IB MB/step | exchange ms | compute ms "
          "(busiest GPU) | overlap needed | efficiency, no overlap | efficiency, full overlap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['ep']} | {r['design']} | {r['nvlink_mb']:.0f} | "
              f"{r['ib_mb']:.0f} | {r['exchange_ms']:.1f} | {r['compute_ms']:.1f} | "
              f"{r['overlap_needed']:.2f} | {r['eff_no_overlap']:.2f} | "
              f"{r['eff_full_overlap']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            meta = {
                "date_utc":
                datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "jax":
                jax.__version__,
                "note":
                "a model: nothing timed; routing statistics from the router on random "
                "tokens and a random router",
            }
            json.dump({"meta": meta, "args": vars(a), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
