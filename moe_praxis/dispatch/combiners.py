"""The combiners: the experts' outputs back into tokens, one registry entry each, in order of
preference (`COMBINERS`; moe_praxis.plan picks the first that applies).

Letters: T tokens of one device, k top_k, R rows (token copies), M d_model.

Every entry runs `run(out [R, M], d: sort.Dispatch, *, weights [T, k], w_sorted [R], num_tokens,
index, backend, tp) -> [T, M]` on one device (weights: the routing weights, float32; w_sorted:
sort.row_weights; index: sort.dispatch_index or None; tp: d_ff is split over tp axes, whose
partial sums are added after the combine, so it stays float32). An entry with
`weights_in_rows` has the experts multiply the routing weights into their activation. Under
expert parallelism the reverse exchange combines (dispatch.exchange; `EXCHANGE`, no `run`).
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_praxis.dispatch import sort
from moe_praxis.ops import vma
from moe_praxis.variants import Entry


def _gather_sum(out, d, *, weights, w_sorted, num_tokens, index, backend, tp):
    del w_sorted, index
    w = vma.vary(weights, tuple(vma.varying_axes(out)))
    return sort.combine_gather(out,
                               w,
                               d,
                               num_tokens,
                               jnp.float32 if tp else out.dtype,
                               backend=backend)


def _sorted_combine(weighted: bool):
    """The unpermute of the sorted rows: plain (the weights are in the rows) or, weighted, the
    float32 sum of w_sorted x rows (sort.combine_sorted)."""

    def run(out, d, *, weights, w_sorted, num_tokens, index, backend, tp):
        del weights, tp
        return sort.combine_sorted(out,
                                   w_sorted,
                                   d.row_map,
                                   num_tokens,
                                   weighted,
                                   backend=backend,
                                   index=index)

    return run


EXCHANGE = Entry(
    "exchange", lambda q: "expert parallelism: the reverse exchange and its combine"
    if q.ep_size > 1 else "", None)
GATHER_SUM = Entry(
    "gather_sum", lambda q: "gather_combine: one gather-and-sum over each token's k rows"
    if q.config.gather_combine else "", _gather_sum)
UNPERMUTE = Entry("unpermute",
                  lambda q: "no tp: the routing weights go into the activation, a plain "
                  "unpermute" if not q.tp else "",
                  _sorted_combine(False),
                  weights_in_rows=True)
WEIGHTED_SUM = Entry("weighted_sum",
                     lambda q: "tp: the float32 weighted sum, the tp partial sums added after",
                     _sorted_combine(True))

# The registry, in order of preference: one line per combiner.
COMBINERS = (
    EXCHANGE,
    GATHER_SUM,
    UNPERMUTE,
    WEIGHTED_SUM,
)
