"""Generating text from a trained job: restore its newest checkpoint, prefill, decode.

``generate(job_log_dir, prompts, max_new_tokens=...)`` is the whole thing; ``load_sampler``
and ``Sampler.sample`` (``experiments.sample.decoding``) are the layer below it (token ids,
log-probabilities, timings).

- The job's recorded config (``config.json``) and tokenizer are used, and its newest checkpoint
  that restores (``experiments.train.checkpoints``), with the shardings of training on the job's
  mesh: the batch is split over the token axes (data parallel), the experts stay sharded as
  trained. Sampling writes nothing into the job directory.
- Every MoE layer is dropless at decode whatever capacity it trained with (``decode_config``):
  the same router, scores, groups, expert bias and shared experts, no capacity and no bound on
  the expert-parallel buffers. The dropped copies are counted anyway (``Samples.dropped``).
- The next token: ``experiments.sample.sampling`` (greedy, temperature, top-k, top-p).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import jax

import moe_praxis  # noqa: F401  (Praxis shims before praxis is imported)
from praxis import base_layer

from configs import experiments as exp_configs
from configs import models
from experiments.job import jobdir
from experiments.train import setup
from experiments import tokenizer as tokenizer_lib
from experiments.tokenizer import job_copy as tokenizer_copy
from experiments.train.checkpoints import Checkpoints
from experiments.sample.decoding import Sampler, Samples  # noqa: F401  (this module's API)
from experiments.job.errors import one_line
from experiments.sample.sampling import (
    SampleError,
    check_prompts,
    check_settings,  # noqa: F401
    fitting_new_tokens)
from experiments.train.steps import make_step_fns

# ------------------------------------------------------------------------------ tokenizer


class PromptTokenizer:
    """The tokenizer a job trained with (``experiments.tokenizer.job_tokenizer``: the copy its
    directory keeps, bytes when it keeps none), encoding prompts as the training documents
    began: with the BOS id first when the job's data added one (``data.add_bos``)."""

    def __init__(self, tokenizer, add_bos: bool):
        self.tokenizer = tokenizer
        self.add_bos = bool(add_bos) and tokenizer.bos_id is not None

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        return [self.tokenizer.bos_id] + ids if self.add_bos else ids


def job_tokenizer(job_log_dir, data_config=None) -> PromptTokenizer:
    """The tokenizer ``job_log_dir`` trained with (encode, decode, eos_id); ``data_config``: the
    job's recorded DataConfig (its ``tokenizer`` and ``add_bos``). Raises SampleError (one line)
    when a job trained with a tokenizer file keeps no copy of it, or a copy that does not load
    or whose content changed."""
    kept = Path(job_log_dir) / tokenizer_copy.TOKENIZER_DIR
    spec = getattr(data_config, "tokenizer", tokenizer_lib.BYTES)
    fix = (f"restore {kept}/ (the file and its {tokenizer_copy.HASH_FILE}) or point "
           "--job_log_dir at a complete job")
    try:
        if spec != tokenizer_lib.BYTES and tokenizer_copy.job_tokenizer_path(job_log_dir) is None:
            raise SampleError(f"--job_log_dir={str(job_log_dir)!r} was trained with "
                              f"data.tokenizer={spec!r} but keeps no copy of it in {kept}: {fix}")
        tok = tokenizer_copy.job_tokenizer(job_log_dir)
    except (tokenizer_lib.TokenizerError, OSError) as e:
        raise SampleError(f"the tokenizer copy of --job_log_dir={str(job_log_dir)!r} does not "
                          f"load ({type(e).__name__}: {one_line(e)}): {fix}") from None
    return PromptTokenizer(tok, getattr(data_config, "add_bos", False))


# ------------------------------------------------------------------------------- restore


def decode_config(model_cfg, *, dropless: bool = True):
    """A copy of a TransformerLm config whose MoE layers are dropless: gating_func 'top2'
    (GShard's capacity) becomes 'dense_top2' (the same softmax top-2, no capacity),
    ``capacity_factor`` and ``ep_buffer_factor`` None; the sequence-wise balance loss (not part
    of the output) becomes the token-wise one. Weights and routing are unchanged."""
    cfg = copy.deepcopy(model_cfg)
    block = models.stack_block(cfg)
    if dropless and block.gating_func == "top2":
        block.gating_func = "dense_top2"
    stack = cfg.stacked_transformer_tpl
    if hasattr(stack, "unroll_in_decode"):  # Praxis's unrolled decode drops the summaries
        stack.unroll_in_decode = False  # (the dropped-copy counts): scan the repeats
    moe = block.moe_layer_tpl
    if moe is not None:
        if dropless:
            moe.capacity_factor = None
            moe.ep_buffer_factor = None
        if moe.aux_loss_type == "sequence":  # it needs whole sequences, a step has one token
            moe.aux_loss_type = "switch"  # (aux losses are not part of the output)
    # The sampler's rows are left-padded prompts: the attention applies the mask as given.
    models.set_attention(cfg, padded_rows=True)
    return cfg


def recorded_config(job_log_dir):
    """The experiment config recorded in ``job_log_dir``. Raises SampleError (one line) for a
    directory that does not exist (naming the runs beside it with a close name), or one without
    a recorded config or without a checkpoint."""
    job_log_dir = Path(job_log_dir).absolute()
    ckpt_dir = job_log_dir / "checkpoints"
    try:
        jobdir.check_readable(job_log_dir)  # a mistyped directory: the runs beside it
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
    tokenizer = job_tokenizer(job_log_dir, cfg.data)
    if mesh:
        exp_configs.use_mesh(cfg, **mesh)
    cfg.model = decode_config(cfg.model, dropless=dropless)
    try:
        prep = setup.prepare(cfg,
                             devices=devices,
                             job_log_dir=job_log_dir,
                             load_data=False,
                             tokenizer_given=False)  # the job's own copy
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
    return Sampler(prep, variables, tokenizer, step=step)


@dataclasses.dataclass
class Continuations:
    """What ``continuations`` returns."""
    texts: list  # per prompt, its samples' texts: tokenizer.decode of the ids, EOS left out
    samples: Samples  # the token ids (prompts with BOS where the data added one), timings
    tokenizer: PromptTokenizer
    step: int  # the checkpoint's
    settings: dict  # what was sampled with (max_new_tokens resolved where it was None)


def continuations(job_log_dir,
                  prompts: Sequence[str],
                  settings: dict,
                  *,
                  seed: int = 0,
                  use_cache: bool = True,
                  stop_at_eos: bool = False,
                  progress: bool = False) -> Continuations:
    """``generate`` and ``--mode=sample``: the prompts encoded with the job's tokenizer and
    continued by its newest checkpoint. settings: ``check_settings``'s keywords
    (``max_new_tokens`` None: as many as fit, ``fitting_new_tokens``). Every setting and prompt
    is checked before anything is restored (SampleError, one line)."""
    check_settings(**settings)
    cfg = recorded_config(job_log_dir)
    tok = job_tokenizer(job_log_dir, cfg.data)
    prompt_ids = [tok.encode(p) for p in prompts]
    if settings["max_new_tokens"] is None:  # as many as fit
        settings = {**settings, "max_new_tokens": fitting_new_tokens(prompt_ids, cfg.data.seq_len)}
    check_prompts(prompt_ids, settings["max_new_tokens"], cfg.data.seq_len, tok.vocab_size)
    sampler = load_sampler(job_log_dir)
    out = sampler.sample(prompt_ids,
                         seed=seed,
                         use_cache=use_cache,
                         stop_at_eos=stop_at_eos,
                         progress=progress,
                         **settings)
    texts = [tok.decode([t for t in ids if t != tok.eos_id]) for ids in out.tokens]
    n = out.num_samples
    return Continuations([texts[i * n:(i + 1) * n] for i in range(len(prompts))], out, tok,
                         sampler.step, settings)


def generate(job_log_dir,
             prompts: Sequence[str],
             *,
             max_new_tokens: int | None = None,
             temperature: float = 0.0,
             top_k: int = 0,
             top_p: float = 1.0,
             num_samples: int = 1,
             seed: int = 0,
             use_cache: bool = True) -> list[list[str]]:
    """Continuations of each prompt (a list of ``num_samples`` strings per prompt: the decoded
    ids, EOS left out) by the newest checkpoint of ``job_log_dir``; settings as
    ``experiments.sample.sampling`` describes (``max_new_tokens`` None: the context minus the longest
    prompt)."""
    settings = dict(max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    num_samples=num_samples)
    return continuations(job_log_dir, prompts, settings, seed=seed, use_cache=use_cache).texts
