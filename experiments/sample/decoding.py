"""The Sampler: left-padded prefill, then a KV-cached decode loop (``experiments.sample``
builds it from a job directory).

The prompts of one batch are left-padded to the longest (columns [0, pad) padding, token
positions counted from each prompt's first token), in a buffer of the model's context
(``data.seq_len``) tokens. Prefill is the full forward over the buffer with ``start_time_step``
= the longest prompt (Praxis's decode caches); each further token is one
``TransformerLm.extend_step``: one compiled prefill and one compiled step per batch size,
whatever the prompt lengths and the number of new tokens. ``use_cache=False`` recomputes the
whole buffer for every token (the reference). The batch is split over the mesh's token axes
(padded with copies of the first row to a multiple of their size). The next token:
``experiments.sample.sampling``, from the logits of the tokenizer's ids only: a model vocabulary
rounded up past the tokenizer's (``experiments.train.setup``) has ids that are no token, never drawn.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis  # noqa: F401  (Praxis shims before praxis is imported)
from praxis import base_layer

from configs import models
from experiments.sample import sampling
from experiments.train import setup
from experiments.sample.sampling import check_prompts, check_settings, SampleError

P = jax.sharding.PartitionSpec
CACHE, SUMMARIES = base_layer.DECODE_CACHE, base_layer.SUMMARIES
PROGRESS_MIN_TOKENS = 64  # a progress bar is drawn for generations at least this long
# Decode steps the host may dispatch ahead of the devices. Unbounded, the loop queues every
# step's programs at once, and XLA:CPU deadlocks on a multi-device mesh: a program's launch
# waits for a per-device slot (32 in flight per device) on a thread of the same pool the queued
# programs need to finish and free their slots, so some devices never start a program whose
# collective the others wait in, and after 40 s the rendezvous aborts the process ("Fatal
# Python error: Aborted"). A few steps ahead keep an accelerator's queue as full as many.
STEPS_IN_FLIGHT = 2


@dataclasses.dataclass
class Samples:
    """What ``Sampler.sample`` returns. Row r = prompt r // num_samples, sample r % num_samples.

    tokens / log_probs: per row, the generated ids (up to and including an EOS when
      stop_at_eos) and each one's log-probability (``experiments.sample.sampling``).
    dropped: the MoE layers' fractions of dropped token copies, summed over the layers, the
      prefill and the decode steps (0: nothing dropped; dropless decoding keeps it 0).
    logits: [rows, steps, V] float32, the logits each token was chosen from (when asked for;
      V: the tokenizer's vocabulary, ``Sampler.vocab``).
    """
    prompts: list
    tokens: list
    log_probs: list
    num_samples: int
    prefill_seconds: float
    decode_seconds: float  # the timed decode steps (the first, compiling, one excluded)
    timed_steps: int
    compile_seconds: float
    dropped: float
    logits: Optional[np.ndarray] = None

    @property
    def decode_tokens_per_second(self) -> float:
        rows = len(self.tokens)
        return rows * self.timed_steps / self.decode_seconds if self.decode_seconds else math.nan

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.decode_seconds / self.timed_steps if self.timed_steps else math.nan


def _masks(pad, t, s):
    """paddings [B, s] (1 left of a row's prompt and at columns >= t), positions [B, s]."""
    j = jnp.arange(s)[None, :]
    paddings = ((j < pad[:, None]) | (j >= t)).astype(jnp.float32)
    return paddings, jnp.maximum(j - pad[:, None], 0).astype(jnp.int32)


def _dropped_fraction(summaries):
    """Sum over the MoE layers of their dropped-copy fractions (a [] float32)."""
    leaves = jax.tree_util.tree_flatten_with_path(summaries)[0]
    vals = [
        jnp.sum(v.astype(jnp.float32)) for p, v in leaves
        if "moe_dropped_token_fraction" in jax.tree_util.keystr(p)
    ]
    return sum(vals, jnp.float32(0))


class Sampler:
    """A restored job, ready to sample (built by ``load_sampler``)."""

    def __init__(self, prep: setup.Prepared, variables, tokenizer, *, step: int):
        self.prep, self.model, self.mesh = prep, prep.model, prep.mesh
        self.variables = variables
        self.tokenizer = tokenizer
        self.step = step
        self.context = prep.config.data.seq_len
        self.vocab = min(tokenizer.vocab_size, prep.model.vocab_size)  # the ids that are tokens
        block = models.stack_block(prep.model_config)
        self.top_k = block.moe_layer_tpl.num_experts_per_token if block.moe_layers else 0
        token_axes = prep.config.mesh.resources.token_axes
        sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape))
        self.batch_multiple = math.prod(sizes[a] for a in token_axes)
        rows = P(token_axes) if token_axes else P()
        self._rows = jax.sharding.NamedSharding(self.mesh, rows)
        self._ids = jax.sharding.NamedSharding(self.mesh, P(*rows, None))
        self._one = jax.sharding.NamedSharding(self.mesh, P())
        donate = (1, ) if self.mesh.devices.flat[0].platform != "cpu" else ()
        # Fixed output shardings: each function sees the same input shardings at every call.
        rows_v = jax.sharding.NamedSharding(self.mesh, P(*rows, None))
        self.prefill_fn = jax.jit(self._prefill, out_shardings=(rows_v, None, self._one))
        self.step_fn = jax.jit(self._extend,
                               donate_argnums=donate,
                               out_shardings=(rows_v, None, self._one))
        self.full_fn = jax.jit(self._full, out_shardings=(rows_v, self._one))
        self.choose_fn = jax.jit(self._choose, out_shardings=(self._rows, ) * 3)
        self.write_fn = jax.jit(self._write)

    # -------------------------------------------------------------- jitted functions

    def _apply(self, variables, *args, **kw):
        ctx = base_layer.JaxContext.HParams(do_eval=True)
        with base_layer.JaxContext.new_context(hparams=ctx):
            return self.model.apply(variables, *args, **kw)

    def _tokens(self, logits):
        """logits [B, model vocabulary] -> [B, self.vocab] float32: the tokenizer's ids."""
        return logits[:, :self.vocab].astype(jnp.float32)

    def _prefill(self, variables, ids, pad, start):
        """Full forward of ids [B, S] up to column start (exclusive): the logits [B, V] that
        choose column start's token, the decode cache (time_step = start), dropped copies."""
        paddings, pos = _masks(pad, start, ids.shape[1])
        out, upd = self._apply(variables,
                               ids,
                               paddings,
                               segment_ids=(1 - paddings).astype(jnp.int32),
                               segment_pos=pos,
                               start_time_step=start,
                               mutable=[CACHE, SUMMARIES])
        logits = jnp.take(out.logits, start - 1, axis=1)
        return self._tokens(logits), upd[CACHE], _dropped_fraction(upd.get(SUMMARIES, {}))

    def _extend(self, variables, cache, tokens, pad):
        """One cached step: tokens [B] at column cache['time_step'] -> logits [B, V] for the
        next column, the cache, dropped copies."""
        pos = (cache["time_step"] - pad).astype(jnp.int32)
        out, upd = self._apply({
            **variables, CACHE: cache
        },
                               tokens,
                               segment_pos=pos,
                               method=self.model.extend_step,
                               mutable=[CACHE, SUMMARIES])
        return self._tokens(out.logits), upd[CACHE], _dropped_fraction(upd.get(SUMMARIES, {}))

    def _full(self, variables, ids, pad, t):
        """The reference: the full forward over ids [B, S] with columns >= t padding; the
        logits [B, V] that choose column t's token and the dropped copies."""
        paddings, pos = _masks(pad, t, ids.shape[1])
        out, upd = self._apply(variables,
                               ids,
                               paddings,
                               segment_ids=(1 - paddings).astype(jnp.int32),
                               segment_pos=pos,
                               mutable=[SUMMARIES])
        logits = jnp.take(out.logits, t - 1, axis=1)
        return self._tokens(logits), _dropped_fraction(upd.get(SUMMARIES, {}))

    @staticmethod
    def _choose(logits, seed, rows, n, temperature, top_k, top_p, done, eos):
        keys = sampling.row_keys(seed, rows, n)
        tokens, lp = sampling.choose(logits, keys, temperature, top_k, top_p)
        return tokens, lp, done | (tokens == eos)

    @staticmethod
    def _write(ids, tokens, t):
        return jax.lax.dynamic_update_slice(ids, tokens[:, None], (jnp.int32(0), t))

    def compiled(self) -> dict:
        """{function: how many times it was compiled} (one per batch size is the contract)."""
        return {
            name: getattr(self, name)._cache_size()
            for name in ("prefill_fn", "step_fn", "full_fn", "choose_fn")
        }

    # -------------------------------------------------------------------------- sample

    def _put(self, x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def sample(self,
               prompt_ids: Sequence[Sequence[int]],
               *,
               max_new_tokens: int,
               temperature: float = 0.0,
               top_k: int = 0,
               top_p: float = 1.0,
               num_samples: int = 1,
               seed: int = 0,
               use_cache: bool = True,
               stop_at_eos: bool = False,
               progress: bool = False,
               return_logits: bool = False) -> Samples:
        """Continues each prompt (a list of token ids) ``num_samples`` times by
        ``max_new_tokens`` tokens (fewer where every row reached EOS, with stop_at_eos)."""
        check_settings(max_new_tokens=max_new_tokens,
                       temperature=temperature,
                       top_k=top_k,
                       top_p=top_p,
                       num_samples=num_samples)
        check_prompts(prompt_ids, max_new_tokens, self.context, self.vocab)
        eos = self.tokenizer.eos_id
        if stop_at_eos and eos is None:
            raise SampleError(f"--stop_at_eos: the job's tokenizer ({self.tokenizer.name}) has "
                              "no end-of-sequence token; drop --stop_at_eos")
        rows = [list(map(int, p)) for p in prompt_ids for _ in range(num_samples)]
        n_real = len(rows)
        b = -(-n_real // self.batch_multiple) * self.batch_multiple  # a row per token device
        rows += [rows[0]] * (b - n_real)
        longest, s = max(map(len, rows)), self.context
        ids = np.zeros((b, s), np.int32)
        pad = np.array([longest - len(r) for r in rows], np.int32)
        for i, r in enumerate(rows):
            ids[i, pad[i]:longest] = r
        ids, pad_d = self._put(ids, self._ids), self._put(pad, self._rows)
        one = lambda v, dt: self._put(np.asarray(v, dt), self._one)
        settings = (self._put(np.full(b, temperature, np.float32),
                              self._rows), self._put(np.full(b, top_k, np.int32), self._rows),
                    self._put(np.full(b, top_p, np.float32), self._rows))
        row_ids, seed_d = self._put(np.arange(b, dtype=np.int32), self._rows), one(seed, np.int32)
        done = self._put(np.zeros(b, bool), self._rows)
        eos_d = one(-1 if not stop_at_eos else eos, np.int32)
        v = self.variables
        tokens, lps, logits_seen, dropped = [], [], [], []
        compile_s, decode_s, timed = 0.0, 0.0, 0
        bar = None
        if progress and max_new_tokens >= PROGRESS_MIN_TOKENS:
            from tqdm import tqdm

            bar = tqdm(total=max_new_tokens, unit="tok", desc="decode", file=sys.stderr)
        with jax.set_mesh(self.mesh):
            start = one(longest, np.int32)
            first = self.prefill_fn if use_cache else self.full_fn
            args = (v, ids, pad_d, start)
            for attempt in range(2):  # a compiling call is timed again without compiling
                before = first._cache_size()
                t0 = time.perf_counter()
                out = jax.block_until_ready(first(*args))
                prefill_s = time.perf_counter() - t0
                if first._cache_size() == before:
                    break
                compile_s += prefill_s
            logits, cache = out[0], (out[1] if use_cache else None)
            dropped.append(out[-1])
            t0 = time.perf_counter()
            for n in range(max_new_tokens):
                tok, lp, done = self.choose_fn(logits, seed_d, row_ids, one(n, np.int32), *settings,
                                               done, eos_d)
                tokens.append(tok)
                lps.append(lp)
                if return_logits:
                    logits_seen.append(logits)
                if bar is not None:
                    jax.block_until_ready(tok)
                    bar.update(1)
                if n == max_new_tokens - 1:
                    break
                if stop_at_eos and n % 8 == 7 and bool(np.all(jax.device_get(done)[:n_real])):
                    break
                if n >= STEPS_IN_FLIGHT:
                    jax.block_until_ready(tokens[n - STEPS_IN_FLIGHT])
                fn = self.step_fn if use_cache else self.full_fn
                before = fn._cache_size()
                if use_cache:
                    logits, cache, d = fn(v, cache, tok, pad_d)
                else:
                    ids = self.write_fn(ids, tok, one(longest + n, np.int32))
                    logits, d = fn(v, ids, pad_d, one(longest + n + 1, np.int32))
                dropped.append(d)
                if fn._cache_size() != before:  # compiled: its time is not decode time
                    jax.block_until_ready(logits)
                    compile_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                else:
                    timed += 1
            jax.block_until_ready(tokens[-1])
            decode_s = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        toks = np.stack(jax.device_get(tokens), axis=1)[:n_real]
        lp = np.stack(jax.device_get(lps), axis=1)[:n_real]
        frac = float(sum(float(x) for x in jax.device_get(dropped)))
        out_tokens, out_lps = [], []
        for r in range(n_real):
            k = len(toks[r])
            if stop_at_eos:
                hits = np.flatnonzero(toks[r] == eos)
                k = int(hits[0]) + 1 if hits.size else k
            out_tokens.append([int(t) for t in toks[r, :k]])
            out_lps.append([float(x) for x in lp[r, :k]])
        seen = np.stack(jax.device_get(logits_seen), axis=1)[:n_real] if return_logits else None
        return Samples(prompts=rows[:n_real],
                       tokens=out_tokens,
                       log_probs=out_lps,
                       num_samples=num_samples,
                       prefill_seconds=prefill_s,
                       decode_seconds=decode_s,
                       timed_steps=timed,
                       compile_seconds=compile_s,
                       dropped=frac,
                       logits=seen)
