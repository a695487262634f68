"""benchmarks/ep_model.py: the exchange model's routing statistics and byte counts."""

import numpy as np
import pytest

from benchmarks import ep_model


def test_group_limited_routing_reaches_at_most_group_topk_nodes_at_ep64():
    """At ep 64 a node's 8 GPUs hold one expert group of 32, so DeepSeek-V3's group limit
    (top-4 groups) is a node limit: no token reaches more than 4 nodes."""
    ids = ep_model.sample_expert_ids(4096, seed=int(np.random.SeedSequence().entropy % 2**31))
    assert ids.shape == (4096, ep_model.K)
    assert ep_model.exchange_stats(ids, 64)["max_nodes_per_token"] <= ep_model.GROUP_TOPK
    # at ep 256 a group spans 4 nodes: more nodes per token are possible, and seen
    assert ep_model.exchange_stats(ids, 256)["max_nodes_per_token"] > ep_model.GROUP_TOPK


def test_per_copy_bytes_match_hand_count_for_uniform_routing():
    """Uniform routing to 256 experts on ep 64: 8 copies per token, 56/64 of them off the node
    and 7/64 on other GPUs of the node; four bf16 transfers of M columns each."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
    ids = np.stack([rng.permutation(ep_model.E)[:ep_model.K] for _ in range(20000)])
    rows = ep_model.model(ids, "64", 64, 1000, 10.0, 100.0, 10.0)
    copy = next(r for r in rows if r["design"] == "per-copy bf16")
    row_bytes = ep_model.M * 2 * ep_model.TRANSFERS * 1000
    np.testing.assert_allclose(copy["ib_mb"] * 1e6, 8 * 56 / 64 * row_bytes, rtol=0.03)
    np.testing.assert_allclose(copy["nvlink_mb"] * 1e6, 8 * 7 / 64 * row_bytes, rtol=0.05)
    ds = next(r for r in rows if r["design"] == "DeepSeek-V3")
    assert ds["ib_mb"] < copy["ib_mb"]  # one row per node, not per copy
    assert copy["exchange_ms"] == pytest.approx(max(copy["ib_mb"] / 10.0,
                                                    copy["nvlink_mb"] / 100.0))
