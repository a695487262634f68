"""What the execution plan's registries share: the question an entry answers, the rows a
dispatcher hands the experts, and the pick of the first entry that applies.

Letters: T tokens of one device, R rows (token copies), M d_model.

A registry (moe_praxis.dispatch.dispatchers, moe_praxis.experts, moe_praxis.dispatch.combiners)
is a tuple of `Entry`s in order of preference. Each entry's `choose(query)` returns why it runs
this call ('' where it does not apply; a fallback it causes warns there, once); the plan
(moe_praxis.plan.resolve_plan) takes the first entry with a reason, before anything is traced,
and the block body only calls what the plan holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from moe_praxis.config import MoEConfig
from moe_praxis.ops import vma


@dataclasses.dataclass(frozen=True)
class Query:
    """What an entry's `choose` may look at: static facts of one moe_block call."""
    config: MoEConfig  # the config the call runs (expert_weights.fp8_for_call applied)
    backend: str  # the resolved kernel backend, 'xla' | 'cuda'
    ep_size: int  # EP ranks (1: no exchange)
    tp: bool  # d_ff is split over tp axes (partial sums added after the combine)
    x: jax.ShapeDtypeStruct  # [T, M] one device's tokens
    weights: dict  # {name: ShapeDtypeStruct} one EP rank's expert weights, fsdp-gathered, cast
    fp8_gather: bool  # the FP8 GEMMs all-gather their weights themselves (experts.FP8_GATHER)
    fp8_given: bool  # the expert weights' FP8 form came in with the parameters


@dataclasses.dataclass(frozen=True)
class Rows:
    """The experts' input, in the form a dispatcher made it.

    rows: [R, M] expert-sorted rows (None where `source` is given); rows_up: [R, M] the same
    rows again for the up projection (their two cotangents summed in the permute's backward);
    rows_fp8: (q, s_t) the rows' FP8 operand written by the permute; source: (x [T, M], row_map
    [R], index) where the experts make the rows = permute(x, row_map) themselves, to gather them
    again in the backward (MoEConfig.regather_rows; index: ops.permute_index's or None)."""
    rows: Optional[jax.Array] = None
    rows_up: Optional[jax.Array] = None
    rows_fp8: Optional[tuple] = None
    source: Optional[tuple] = None

    def varying_axes(self) -> tuple:
        """The mesh axes the rows vary over (shard_map's type; () outside shard_map)."""
        return tuple(vma.varying_axes(self.rows if self.source is None else self.source[0]))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registry entry: `choose(query) -> str` (why it runs; '' = it does not apply) and
    `run`, whose signature is its registry's (the module of the registry states it)."""
    name: str
    choose: Callable[[Query], str]
    run: Callable[..., Any]
    # dispatchers: the rows made from the exchanged rows under EP (None: not under EP)
    regrouped: Optional[Callable[..., Any]] = None
    # combiners: the routing weights go into the experts' activation (row_weights)
    weights_in_rows: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """A registry entry chosen for a call, and why."""
    entry: Entry
    reason: str

    @property
    def name(self) -> str:
        return self.entry.name


def pick(entries: tuple, query: Query, what: str) -> Choice:
    """The first of `entries` whose choose(query) gives a reason."""
    for entry in entries:
        why = entry.choose(query)
        if why:
            return Choice(entry, why)
    raise ValueError(f"no {what} applies to this call; registered: {[e.name for e in entries]}")
