"""The dispatchers: how the expert-sorted rows reach the experts, one registry entry each, in
order of preference (`DISPATCHERS`; moe_praxis.plan picks the first that applies).

Letters: T tokens of one device, R rows (token copies), M d_model, N exchanged rows.

Every entry runs `run(x [T, M], d: sort.Dispatch, index, *, backend, axes) -> variants.Rows`
on one device's tokens (index: sort.dispatch_index, or None; axes: the mesh axes the expert
weights vary over, which the rows are marked to vary over too), and under expert parallelism
`regrouped(rows [N, M], perm [N]) -> variants.Rows` on the exchanged rows (an entry without it
must not apply there: its `choose` returns '' where query.ep_size > 1).
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

from moe_praxis.dispatch import sort
from moe_praxis.experts.common import reads_rows_twice
from moe_praxis.ops import vma
from moe_praxis.ops.backend import warn_once
from moe_praxis.ops.fp8 import recipe as fp8
from moe_praxis.variants import Entry, Query, Rows


def _dispatched(rows, axes):
    return vma.vary(checkpoint_name(rows, "moe_dispatched"), axes)


def _permute(x, d, index, *, backend, axes) -> Rows:
    return Rows(rows=_dispatched(sort.dispatch_rows(x, d, backend=backend, index=index), axes))


def _regrouped(rows, perm) -> Rows:
    return Rows(rows=checkpoint_name(rows[perm], "moe_dispatched"))


def _permute_pair(x, d, index, *, backend, axes) -> Rows:
    rows, rows_up = sort.dispatch_rows_pair(x, d, backend=backend, index=index)
    return Rows(rows=_dispatched(rows, axes), rows_up=_dispatched(rows_up, axes))


def _permute_fp8(x, d, index, *, backend, axes) -> Rows:
    del index, backend  # the FP8 permute kernel makes its own
    rows, rows_fp8 = sort.dispatch_rows_fp8(x, d)
    return Rows(rows=_dispatched(rows, axes), rows_fp8=tuple(vma.vary(a, axes) for a in rows_fp8))


def _source(x, d, index, *, backend, axes) -> Rows:
    del backend  # the experts' op permutes on the block's backend
    return Rows(source=(vma.vary(x, axes), d.row_map, index))


def _regather_applies(q: Query) -> str:
    if not q.config.regather_rows:
        return ""
    if q.ep_size > 1:
        warn_once(
            "regather_rows has no effect under expert parallelism (ep > 1): the experts' rows "
            "are the exchange's output, not a permute of x, and are kept for the backward",
            RuntimeWarning)
        return ""
    return ("regather_rows: the experts permute x themselves and again in their backward "
            "(ops.regathered_gemms, ops.gate_up_swiglu_regathered), keeping no [R, M] rows")


def _fp8_permute_applies(q: Query) -> str:
    if q.ep_size == 1 and q.config.fp8 is not None and fp8.resolve(q.backend) == "cuda" \
            and not q.fp8_gather:
        return "fp8 on the FP8 kernels: the permute writes the rows' FP8 operand in its pass"
    return ""


def _pair_applies(q: Query) -> str:
    if q.ep_size == 1 and reads_rows_twice(q.config):
        return ("two projections read the rows: their cotangents are summed in the permute's "
                "backward")
    return ""


REGATHER = Entry("regather", _regather_applies, _source)
PERMUTE_FP8 = Entry("permute_fp8", _fp8_permute_applies, _permute_fp8)
PERMUTE_PAIR = Entry("permute_pair", _pair_applies, _permute_pair)
PERMUTE = Entry("permute", lambda q: "a permuted copy of the rows", _permute, regrouped=_regrouped)

# The registry, in order of preference: one line per dispatcher.
DISPATCHERS = (
    REGATHER,
    PERMUTE_FP8,
    PERMUTE_PAIR,
    PERMUTE,
)
