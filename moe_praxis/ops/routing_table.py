"""The router's choices, defined once: score function x pre/post softmax -> math, kernel mode.

One row of CHOICES per (score_func, pre_softmax) the router implements. A row holds the math
of its choice as four functions of float arrays (any float dtype: float32 in the op, float64
in the tests' reference), the fused CUDA kernel's mode for it (None: no kernel, the reference
runs with a warning) and the text of docs/config.md's router-math table. Letters: T tokens,
E experts, k top_k; s the dense scores, b the optional expert bias (selection only).

Read by: MoEConfig's validation (moe_praxis.config), the op's reference and the CUDA path's
mode attribute (moe_praxis.ops.router), the tests' float64 reference
(tests/kernel_reference.py) and the generated docs (`python -m moe_praxis.config --write`).
Normalisation (norm_topk), group-limited top-k, the bias and the scaling are the same for
every row and live in the op; a row's `weights` decides whether norm_topk applies to it.
Adding a score function is one row here (and a kernel mode in kernels/router_kernels.cuh if
the fused kernel is to run it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

# The router GEMM's precision (MoEConfig.router_precision; ops.router.router_gemm).
ROUTER_PRECISIONS = ("float32", "tf32", "bf16", "bf16x3", "auto")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One routing choice: its math, its CUDA kernel mode and its documentation."""
    score_func: str
    pre_softmax: bool
    scores: Callable  # logits [T, E] -> s [T, E]
    probs: Callable  # s [T, E] -> the load-balancing loss's probabilities [T, E], rows sum 1
    selects: Callable  # (logits, s) -> what top-k (plus b) selects on [T, E]
    weights: Callable  # (logits, s, ids [T, k], norm_topk) -> unscaled weights [T, k]
    kernel_mode: Optional[int]  # ScoreMode in kernels/router_kernels.cuh; None = no kernel
    selection_doc: str
    weights_doc: str
    models: str


def _same(s):
    return s


def _sum_to_one(s):
    return s / jnp.sum(s, axis=-1, keepdims=True)


def _on_scores(logits, s):
    del logits
    return s


def _on_logits(logits, s):
    del s
    return logits


def scores_at_ids(logits, s, ids, norm_topk):
    """s[ids], divided by their sum if norm_topk (exactly 1, with zero gradient, for k = 1)."""
    del logits
    w = jnp.take_along_axis(s, ids, axis=-1)
    if norm_topk and ids.shape[-1] == 1:
        return jnp.ones_like(w)
    if norm_topk:
        return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w


def _softmax_at_ids(logits, s, ids, norm_topk):
    """softmax over the k selected logits (sums to 1 already: norm_topk changes nothing)."""
    del s, norm_topk
    return jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=-1), axis=-1)


# A row that selects on the dense scores and weights by them: the pre-softmax rows.
_on_scores_row = functools.partial(Choice,
                                   pre_softmax=True,
                                   selects=_on_scores,
                                   weights=scores_at_ids,
                                   weights_doc="`s[ids]`, divided by their sum if `norm_topk`")
_ROWS = (
    _on_scores_row(score_func="softmax",
                   scores=jax.nn.softmax,
                   probs=_same,
                   kernel_mode=0,
                   selection_doc="top-k of `s + b`, `s = softmax(logits)` over all E",
                   models="Switch (k=1, `norm_topk=False`), GShard top-2, Mixtral and Qwen3-MoE as "
                   "Hugging Face writes them (`norm_topk=True`), Qwen2-MoE (`norm_topk=False`)"),
    Choice(score_func="softmax",
           pre_softmax=False,
           scores=jax.nn.softmax,
           probs=_same,
           selects=_on_logits,
           weights=_softmax_at_ids,
           kernel_mode=1,
           selection_doc="top-k of `logits + b`",
           weights_doc="`softmax(logits[ids])` over the k (sums to 1; `norm_topk` has no effect)",
           models="Mixtral's and Qwen3-MoE's \"top-k, then softmax\" (alias "
           "`score_func='softmax_topk'`); without a bias the same function as `softmax` with "
           "`norm_topk=True`"),
    _on_scores_row(
        score_func="sigmoid",
        scores=jax.nn.sigmoid,
        probs=_sum_to_one,
        kernel_mode=2,
        selection_doc="top-k of `s + b`, `s = sigmoid(logits)`",
        models="DeepSeek-V3 (with `use_expert_bias`, 8 groups, `routed_scaling_factor=2.5`); "
        "its load-balancing probabilities are `s` divided by its sum"),
)
CHOICES = {(c.score_func, c.pre_softmax): c for c in _ROWS}

# Other names for a row: {alias: (score_func, pre_softmax)}. MoEConfig rewrites an alias to
# its row's fields; the op accepts it too.
ALIASES = {"softmax_topk": ("softmax", False)}


def score_funcs() -> tuple:
    """Every valid score_func: the rows' names, then the aliases."""
    return tuple(dict.fromkeys(sf for sf, _ in CHOICES)) + tuple(ALIASES)


def canonical(score_func: str, pre_softmax: bool) -> tuple:
    """(score_func, pre_softmax) with an alias replaced by its row's fields."""
    return ALIASES.get(score_func, (score_func, bool(pre_softmax)))


def invalid(score_func: str, pre_softmax: bool) -> Optional[tuple]:
    """None if (score_func, pre_softmax) names a row, else (field, what would be valid)."""
    if score_func not in score_funcs():
        return "score_func", f"valid: {score_funcs()}"
    key = canonical(score_func, pre_softmax)
    if key not in CHOICES:
        with_it = tuple(sf for sf, pre in CHOICES if pre == key[1])
        return "pre_softmax", (f"score_func={score_func!r} has no pre_softmax={key[1]} variant; "
                               f"score_func in {with_it} have one")
    return None


def resolve(score_func: str, pre_softmax: bool = True) -> Choice:
    """The row of (score_func, pre_softmax), aliases resolved; ValueError naming the value."""
    bad = invalid(score_func, pre_softmax)
    if bad:
        field, valid = bad
        value = score_func if field == "score_func" else pre_softmax
        raise ValueError(f"{field}={value!r} is invalid: {valid}")
    return CHOICES[canonical(score_func, pre_softmax)]


def markdown_table() -> str:
    """docs/config.md's router-math table, one line per row of CHOICES."""
    rows = [
        "| score_func | pre_softmax | selection | weights | CUDA kernel | used by |",
        "|---|---|---|---|---|---|",
    ]
    for c in CHOICES.values():
        kernel = "yes" if c.kernel_mode is not None else "no (the reference, with a warning)"
        rows.append(f"| `'{c.score_func}'` | `{c.pre_softmax}` | {c.selection_doc} | "
                    f"{c.weights_doc} | {kernel} | {c.models} |")
    aliases = ", ".join(f"`score_func='{a}'` is `score_func='{sf}', pre_softmax={pre}`"
                        for a, (sf, pre) in ALIASES.items())
    return "\n".join(rows) + f"\n\nAliases: {aliases}.\n"
