"""Choosing the next token from the logits: greedy, temperature, top-k, top-p (nucleus).

The distribution a token is drawn from, for logits ``z [V]`` (float32):

  temperature T > 0:  q = softmax(z / T), restricted to the top_k most likely tokens
                      (top_k = 0: all V), then to the nucleus: the most likely tokens, in
                      order, until their mass under the restricted q reaches top_p (the first
                      token is always kept; top_p = 1: all of them), renormalised.
  temperature 0:      greedy, the argmax of z (top_k and top_p cannot change it).

The reported log-probability of a drawn token is log q(token) after every restriction; for
greedy decoding it is the model's own log_softmax(z) at the argmax (temperature 1, nothing
restricted). Every setting is a traced array, so one compiled step serves them all.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from experiments.job.errors import SampleError


def check_settings(*, max_new_tokens, temperature, top_k, top_p, num_samples) -> None:
    """Raises SampleError naming the first setting out of range and what is valid."""
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise SampleError(f"--max_new_tokens={max_new_tokens!r} is invalid: give an int >= 1 (or "
                          "leave it unset: as many as fit the context)")
    if not temperature >= 0 or not math.isfinite(temperature):
        raise SampleError(f"--temperature={temperature!r} is invalid: give a finite value >= 0 "
                          "(0 = greedy)")
    if not isinstance(top_k, int) or top_k < 0:
        raise SampleError(f"--top_k={top_k!r} is invalid: give an int >= 0 (0 = no top-k)")
    if not 0 < top_p <= 1:
        raise SampleError(f"--top_p={top_p!r} is invalid: give a value in (0, 1] (1 = no "
                          "nucleus)")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise SampleError(f"--num_samples={num_samples!r} is invalid: give an int >= 1")


def fitting_new_tokens(prompt_ids: Sequence[Sequence[int]], context: int) -> int:
    """The most new tokens every prompt has room for in a context of ``context`` tokens: the
    context minus the longest prompt (at least 1; ``check_prompts`` refuses a prompt that
    leaves no room)."""
    return max(context - max((len(ids) for ids in prompt_ids), default=0), 1)


def check_prompts(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, context: int,
                  vocab_size: int) -> None:
    """Raises SampleError for no prompt, an empty one, a token outside [0, vocab_size), a
    prompt that leaves no room for one new token in the model's context (how much too long it
    is), or a prompt + max_new_tokens longer than the context (the largest limit that fits)."""
    if not prompt_ids:
        raise SampleError("no prompt given: pass --prompt=TEXT (repeatable) or --prompts_file=F")
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise SampleError(f"prompt {i} is empty: give at least one character")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise SampleError(f"prompt {i} holds token ids {bad[:3]} outside the vocabulary "
                              f"[0, {vocab_size})")
        if len(ids) >= context:  # no positive --max_new_tokens fits
            over = (f"alone exceeds the model's context of {context} tokens (data.seq_len) by "
                    f"{len(ids) - context} tokens" if len(ids) > context else
                    f"alone fills the model's context of {context} tokens (data.seq_len), "
                    "leaving no room for a new token")
            raise SampleError(f"prompt {i} is {len(ids)} tokens: the prompt {over}; shorten it "
                              f"to at most {context - 1} tokens")
        if len(ids) + max_new_tokens > context:
            raise SampleError(
                f"prompt {i} is {len(ids)} tokens: with --max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, longer than the model's context of {context} "
                f"tokens (data.seq_len); shorten the prompt or give --max_new_tokens <= "
                f"{context - len(ids)}")


def restricted_log_probs(logits, temperature, top_k, top_p):
    """logits [B, V] -> log q [B, V] (-inf outside top-k / the nucleus); temperature [B] > 0
    (a row with temperature 0 gets temperature 1), top_k [B] int (0 = V), top_p [B] in (0, 1]."""
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    x = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    order = jnp.argsort(-x, axis=-1, stable=True)  # [B, V] most likely first
    xs = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, v)[:, None]
    xs = jnp.where(keep, xs, -jnp.inf)
    p = jnp.exp(jax.nn.log_softmax(xs, axis=-1))
    before = jnp.cumsum(p, axis=-1) - p  # the mass of the more likely tokens
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    xs = jax.nn.log_softmax(jnp.where(keep, xs, -jnp.inf), axis=-1)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(xs, inverse, axis=-1)


def choose(logits, keys, temperature, top_k, top_p):
    """The next token of each row and its log-probability (module docstring).

    logits: [B, V]; keys: [B] PRNG keys (one per row); temperature, top_k, top_p: [B].
    Returns (tokens [B] int32, log_probs [B] float32).
    """
    logits = logits.astype(jnp.float32)
    logq = restricted_log_probs(logits, temperature, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, logq)
    greedy = jnp.argmax(logits, axis=-1)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    own = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.where(temperature[:, None] > 0, logq, own)
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]


def row_keys(seed, rows, step):
    """[B] keys: row r's key at decode step n is fold_in(fold_in(key(seed), r), n), so a row's
    draws do not depend on the other rows of the batch. seed: [] int; rows: [B] int; step: []."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(rows)
