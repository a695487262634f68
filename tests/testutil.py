"""Helpers shared by the tests: fresh seeds and the norm-wise relative error."""

import numpy as np

from moe_praxis import MoEConfig


def long_options(parser) -> set[str]:
    """The --options of an argparse parser (--help left out), for the docs-in-step tests."""
    return {
        o
        for a in parser._actions
        for o in a.option_strings if o.startswith("--") and o != "--help"
    }


def seed() -> int:
    """A fresh random seed every call (print it in failure messages to reproduce)."""
    return int(np.random.SeedSequence().generate_state(1)[0])


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64 (inf if got has NaN / inf where want is finite)."""
    return sum_err(got, want, want)


def sum_err(got, want, scale) -> float:
    """||got - want|| / ||scale|| in float64, for sums whose terms may cancel: scale is the sum
    of the terms' magnitudes (a float32 sum is exact to a few ulps of that, not of the sum)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(np.asarray(scale, np.float64)), 1e-30))


def router_config(e, k, score_func, pre_softmax, norm_topk, groups, group_topk, scaling, use_bias):
    """The MoEConfig of a router test case (d_model / d_ff do not matter to the router)."""
    return MoEConfig(d_model=8,
                     d_ff=8,
                     num_experts=e,
                     top_k=k,
                     score_func=score_func,
                     pre_softmax=pre_softmax,
                     norm_topk=norm_topk,
                     num_expert_groups=groups,
                     group_topk=group_topk,
                     routed_scaling_factor=scaling,
                     use_expert_bias=use_bias)
