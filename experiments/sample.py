"""Generating text from a trained job: restore its newest checkpoint, prefill, decode.

``generate(job_log_dir, prompts, max_new_tokens=...)`` is the whole thing; ``load_sampler``
and ``Sampler.sample`` are the layer below it (token ids, log-probabilities, timings).

- The job's recorded config (``config.json``) and tokenizer are used, and its newest checkpoint
  that restores (``experiments.checkpoints``), with the shardings of training on the job's
  mesh: the batch is split over the token axes (data parallel), the experts stay sharded as
  trained. Sampling writes nothing into the job directory.
- Every MoE layer is dropless at decode whatever capacity it trained with (``decode_config``):
  the same router, scores, groups, expert bias and shared experts, no capacity and no bound on
  the expert-parallel buffers. The dropped copies are counted anyway (``Samples.dropped``).
- The prompts of one batch are left-padded to the longest (columns [0, pad) padding, token
  positions counted from each prompt's first token), in a buffer of the model's context
  (``data.seq_len``) tokens. Prefill is the full forward over the buffer with
  ``start_time_step`` = the longest prompt (Praxis's decode caches); each further token is one
  ``TransformerLm.extend_step``: one compiled prefill and one compiled step per batch size,
  whatever the prompt lengths and the number of new tokens.
- ``use_cache=False`` recomputes the whole buffer for every token (the reference).
- The next token: ``experiments.sampling`` (greedy, temperature, top-k, top-p).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis  # noqa: F401  (Praxis shims before praxis is imported)
from praxis import base_layer

from configs import experiments as exp_configs
from configs import models
from experiments import jobdir, sampling, setup
from experiments.checkpoints import Checkpoints
from experiments.steps import make_step_fns

P = jax.sharding.PartitionSpec
CACHE, SUMMARIES = base_layer.DECODE_CACHE, base_layer.SUMMARIES
PROGRESS_MIN_TOKENS = 64  # a progress bar is drawn for generations at least this long


class SampleError(ValueError):
    """A bad sampling request or job directory (one line; exit status 2 in the CLI)."""


# ------------------------------------------------------------------------------ tokenizer


class ByteTokenizer:
    """Byte-level text: token i is the byte value i (the data of ``experiments.data``)."""
    name = "bytes"
    vocab_size = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def job_tokenizer(job_log_dir):
    """The tokenizer ``job_log_dir`` trained with (encode, decode, eos_id): byte-level, the only
    kind the data pipeline has recorded so far."""
    del job_log_dir
    return ByteTokenizer()


# ------------------------------------------------------------------------------- settings


def check_settings(*, max_new_tokens, temperature, top_k, top_p, num_samples) -> None:
    """Raises SampleError naming the first setting out of range and what is valid."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SampleError(f"--max_new_tokens={max_new_tokens!r} is invalid: give an int >= 1")
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


def check_prompts(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, context: int,
                  vocab_size: int) -> None:
    """Raises SampleError for no prompt, an empty one, a token outside [0, vocab_size) or a
    prompt + max_new_tokens longer than the model's context."""
    if not prompt_ids:
        raise SampleError("no prompt given: pass --prompt=TEXT (repeatable) or --prompts_file=F")
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise SampleError(f"prompt {i} is empty: give at least one character")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise SampleError(f"prompt {i} holds token ids {bad[:3]} outside the vocabulary "
                              f"[0, {vocab_size})")
        if len(ids) + max_new_tokens > context:
            raise SampleError(
                f"prompt {i} is {len(ids)} tokens: with --max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, longer than the model's context of {context} "
                f"tokens (data.seq_len); shorten the prompt or give --max_new_tokens <= "
                f"{context - len(ids)}")


def decode_config(model_cfg):
    """A copy of a TransformerLm config whose MoE layers are dropless: gating_func 'top2'
    (GShard's capacity) becomes 'dense_top2' (the same softmax top-2, no capacity),
    ``capacity_factor`` and ``ep_buffer_factor`` None. Weights and routing are unchanged."""
    cfg = copy.deepcopy(model_cfg)
    block = models.stack_block(cfg)
    if block.gating_func == "top2":
        block.gating_func = "dense_top2"
    moe = block.moe_layer_tpl
    if moe is not None:
        moe.capacity_factor = None
        moe.ep_buffer_factor = None
    return cfg


# ------------------------------------------------------------------------------- sampler


@dataclasses.dataclass
class Samples:
    """What ``Sampler.sample`` returns. Row r = prompt r // num_samples, sample r % num_samples.

    tokens / log_probs: per row, the generated ids (up to and including an EOS when
      stop_at_eos) and each one's log-probability (``experiments.sampling``).
    dropped: the MoE layers' fractions of dropped token copies, summed over the layers, the
      prefill and the decode steps (0: nothing dropped; dropless decoding keeps it 0).
    logits: [rows, steps, V] float32, the logits each token was chosen from (when asked for).
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
        self.prefill_fn = jax.jit(self._prefill)
        self.step_fn = jax.jit(self._extend, donate_argnums=donate)
        self.full_fn = jax.jit(self._full)
        self.choose_fn = jax.jit(self._choose)
        self.write_fn = jax.jit(self._write)

    # -------------------------------------------------------------- jitted functions

    def _apply(self, variables, *args, **kw):
        ctx = base_layer.JaxContext.HParams(do_eval=True)
        with base_layer.JaxContext.new_context(hparams=ctx):
            return self.model.apply(variables, *args, **kw)

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
        logits = jnp.take(out.logits, start - 1, axis=1).astype(jnp.float32)
        return logits, upd[CACHE], _dropped_fraction(upd.get(SUMMARIES, {}))

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
        return out.logits.astype(jnp.float32), upd[CACHE], _dropped_fraction(upd.get(SUMMARIES, {}))

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
        logits = jnp.take(out.logits, t - 1, axis=1).astype(jnp.float32)
        return logits, _dropped_fraction(upd.get(SUMMARIES, {}))

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
        check_prompts(prompt_ids, max_new_tokens, self.context, self.model.vocab_size)
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


# ------------------------------------------------------------------------- restore, generate


def recorded_config(job_log_dir):
    """The experiment config recorded in ``job_log_dir``. Raises SampleError (one line) for a
    directory without a recorded config or without a checkpoint."""
    job_log_dir = Path(job_log_dir).absolute()
    ckpt_dir = job_log_dir / "checkpoints"
    try:
        cfg = jobdir.load_recorded(job_log_dir)
    except jobdir.JobDirError as e:
        raise SampleError(str(e)) from None
    if cfg is None:
        raise SampleError(f"--job_log_dir={str(job_log_dir)!r} holds no {jobdir.CONFIG_FILE}: "
                          "point --job_log_dir at a trained run")
    if not ckpt_dir.is_dir() or not any(d.name.isdigit() for d in ckpt_dir.iterdir()):
        raise SampleError(f"--job_log_dir={str(job_log_dir)!r} holds no checkpoint in "
                          f"{ckpt_dir}: train first (python -m experiments.main "
                          f"--job_log_dir={job_log_dir}) or point --job_log_dir at a trained run")
    return cfg


def load_sampler(job_log_dir, *, devices=None, mesh=None, dropless: bool = True) -> Sampler:
    """A Sampler for the newest checkpoint of ``job_log_dir`` that restores, with the job's
    recorded config made dropless (``decode_config``).

    devices: the devices of the mesh (default: all); mesh: MeshConfig fields to sample on another
      mesh than the job trained on (``configs.experiments.use_mesh``; the checkpoint is
      resharded on restore), e.g. ``{"shape": (1, 1, 1)}`` on one device.
    dropless: False keeps the training capacity (only to see what it would drop).
    Raises SampleError (one line) for a directory without a recorded config or checkpoint.
    """
    job_log_dir = Path(job_log_dir).absolute()
    ckpt_dir = job_log_dir / "checkpoints"
    cfg = recorded_config(job_log_dir)
    if mesh:
        exp_configs.use_mesh(cfg, **mesh)
    if dropless:
        cfg.model = decode_config(cfg.model)
    try:
        prep = setup.prepare(cfg, devices=devices, load_data=False)
    except setup.ConfigError as e:
        raise SampleError(f"the config recorded in {job_log_dir} does not set up: {e}") from None
    fns = make_step_fns(prep)
    ckpts = Checkpoints(ckpt_dir, max_to_keep=None, abstract_state=fns.abstract_state)
    mngr = ckpts.manager()
    try:
        with jax.set_mesh(prep.mesh):
            state, step, notes = ckpts.restore_newest(mngr, set_aside=False)
    except setup.ConfigError as e:
        raise SampleError(str(e)) from None
    finally:
        mngr.close()
    for note in notes:
        print(f"experiments.sample: note: {note}", file=sys.stderr, flush=True)
    variables = {base_layer.PARAMS: state["params"], **state["non_trainable"]}
    del state  # the optimizer's moments are not needed
    return Sampler(prep, variables, job_tokenizer(job_log_dir), step=step)


def generate(job_log_dir,
             prompts: Sequence[str],
             *,
             max_new_tokens: int,
             temperature: float = 0.0,
             top_k: int = 0,
             top_p: float = 1.0,
             num_samples: int = 1,
             seed: int = 0,
             use_cache: bool = True) -> list[list[str]]:
    """Continuations of each prompt (a list of ``num_samples`` strings per prompt) by the
    newest checkpoint of ``job_log_dir``; settings as ``experiments.sampling`` describes."""
    check_settings(max_new_tokens=max_new_tokens,
                   temperature=temperature,
                   top_k=top_k,
                   top_p=top_p,
                   num_samples=num_samples)
    sampler = load_sampler(job_log_dir)
    out = sampler.sample([sampler.tokenizer.encode(p) for p in prompts],
                         max_new_tokens=max_new_tokens,
                         temperature=temperature,
                         top_k=top_k,
                         top_p=top_p,
                         num_samples=num_samples,
                         seed=seed,
                         use_cache=use_cache)
    texts = [sampler.tokenizer.decode(t) for t in out.tokens]
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
