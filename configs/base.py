"""What an experiment is made of: plain dataclasses that Fiddle configures and the trainer reads.

An experiment config is ``pax_fiddle.Config(ExperimentConfig, model=..., data=..., ...)``; every
leaf can be overridden from the command line (``--fdl.train.num_steps=50``,
``--fdl.model.stacked_transformer_tpl.num_layers=4``). Building it validates every field here
(``__post_init__``) before anything is traced or compiled; ``experiments.train.setup.prepare`` adds
the checks that need more than one part (model vs data, model vs mesh).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

from moe_praxis import MeshResources

DATA_SOURCES = ("pydoc", "synthetic", "text")
PACKINGS = ("concat", "documents")
SCHEDULES = ("cosine", "constant", "linear")
NONFINITE_POLICIES = ("stop", "skip")
MU_DTYPES = ("float32", "bfloat16")
AxisRole = Union[None, str, Sequence[str]]


def _bad(owner: str, field: str, value, valid: str) -> ValueError:
    return ValueError(f"{owner}.{field}={value!r} is invalid: {valid}.")


def _positive_int(owner, name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _bad(owner, name, v, "must be a positive int")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Language-modelling data: documents, a tokenizer, packing (``experiments.data``).

    source: 'pydoc' (the standard library's ``pydoc_data.topics`` text, offline everywhere),
      'synthetic' (a fixed random order-2 Markov chain over bytes, learnable but not trivial),
      'text' (the documents of ``path``: ``experiments.tokenizer.documents``). None (the default):
      'text' when ``path`` is set, else 'pydoc'. pydoc and synthetic are byte-level.
    path: a file, directory or glob of .txt/.md (a document per file), .jsonl (a document per
      line) and .parquet files (a document per row). Setting it selects source='text'.
    text_field: the field of a .jsonl line / the column of a .parquet file holding the text.
    tokenizer: 'bytes' (ids 0-255), a SentencePiece .model file, or a Hugging Face
      tokenizer.json (or a directory holding one).
    add_bos: start each document with the tokenizer's BOS.
    add_eos: end each document with the tokenizer's EOS; None = where the tokenizer has one.
    packing: 'concat' (windows anywhere in the documents joined one after another) or
      'documents' (whole documents in rows, attention and positions never crossing one).
    cache_dir: where tokenized corpora are kept (None: $XDG_CACHE_HOME or ~/.cache, then
      moe_praxis/tokens).
    seq_len: S, tokens per example; an example is S+1 consecutive tokens (inputs, next tokens).
    batch_size: B, the GLOBAL batch (all processes and devices together).
    heldout_fraction: the tail of the corpus (in tokens) held out for evaluation.
    seed: with the step number, fixes the batch of every step: a resumed run sees the same
      batches as an uninterrupted one.
    synthetic_bytes: corpus length of the synthetic source.
    """

    source: Optional[str] = None
    path: Optional[str] = None
    text_field: str = "text"
    tokenizer: str = "bytes"
    add_bos: bool = False
    add_eos: Optional[bool] = None
    packing: str = "concat"
    cache_dir: Optional[str] = None
    seq_len: int = 64
    batch_size: int = 16
    heldout_fraction: float = 0.1
    seed: int = 0
    synthetic_bytes: int = 1 << 18

    def __post_init__(self):
        if self.source is not None and self.source not in DATA_SOURCES:
            raise _bad("DataConfig", "source", self.source, f"valid: {DATA_SOURCES}")
        if self.source == "text" and not self.path:
            raise _bad("DataConfig", "path", self.path,
                       "source='text' needs a file or directory (--fdl.data.path=...)")
        if self.path and self.source not in (None, "text"):
            raise _bad(
                "DataConfig", "source", self.source,
                f"data.path={self.path!r} reads text files; leave source unset (or "
                "'text'), or unset path")
        if self.packing not in PACKINGS:
            raise _bad("DataConfig", "packing", self.packing, f"valid: {PACKINGS}")
        if self.resolved_source != "text" and self.tokenizer != "bytes":
            raise _bad(
                "DataConfig", "tokenizer", self.tokenizer,
                f"source={self.resolved_source!r} is byte-level; set data.path to text "
                "files to use a tokenizer")
        for name in ("seq_len", "batch_size", "synthetic_bytes"):
            _positive_int("DataConfig", name, getattr(self, name))
        if not 0.0 < self.heldout_fraction < 1.0:
            raise _bad("DataConfig", "heldout_fraction", self.heldout_fraction, "must be in (0, 1)")

    @property
    def resolved_source(self) -> str:
        return self.source or ("text" if self.path else "pydoc")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax AdamW with warmup and a decay schedule, after global-norm gradient clipping.

    learning_rate: peak learning rate, reached after ``warmup_steps``.
    schedule: 'cosine' (to ``end_lr_fraction * learning_rate`` at ``decay_steps``),
      'linear' (same end point, linear), 'constant'.
    decay_steps: 0 = the experiment's ``train.num_steps`` at the job's first start (resolved
      then and recorded: ``experiments.train.setup.resolve_lengths``).
    clip_norm: gradients are scaled so their global L2 norm is at most this (0 = off).
    mu_dtype: the dtype AdamW keeps its first moment in: 'float32', or 'bfloat16' (half the
      moment's memory and bytes moved by the update; the moment is upcast and the update
      computed in float32, the result rounded once when stored). The second moment stays
      float32.
    """

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    schedule: str = "cosine"
    decay_steps: int = 0
    end_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    mu_dtype: str = "float32"

    def __post_init__(self):
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise _bad("OptimizerConfig", "learning_rate", self.learning_rate, "must be > 0")
        if self.schedule not in SCHEDULES:
            raise _bad("OptimizerConfig", "schedule", self.schedule, f"valid: {SCHEDULES}")
        for name in ("warmup_steps", "decay_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise _bad("OptimizerConfig", name, v, "must be an int >= 0")
        if not 0.0 <= self.end_lr_fraction <= 1.0:
            raise _bad("OptimizerConfig", "end_lr_fraction", self.end_lr_fraction,
                       "must be in [0, 1]")
        if self.clip_norm < 0:
            raise _bad("OptimizerConfig", "clip_norm", self.clip_norm, "must be >= 0 (0 = off)")
        if self.weight_decay < 0:
            raise _bad("OptimizerConfig", "weight_decay", self.weight_decay, "must be >= 0")
        if self.mu_dtype not in MU_DTYPES:
            raise _bad("OptimizerConfig", "mu_dtype", self.mu_dtype, f"valid: {MU_DTYPES}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A device mesh (shape + axis names) and the role each axis plays (``MeshResources``).

    shape: one size per axis; one entry may be -1 = every device not used by the others (the
      default mesh ``(-1,)`` is data parallel over whatever devices the machine has).
    axis_names: one name per axis.
    dp, fsdp, ep, tp: the axis (name, tuple of names, or None) playing each role, exactly the
      fields of ``moe_praxis.MeshResources``, which ``resources`` holds.
    fsdp_dim: MeshResources.fsdp_dim: fsdp shards the expert weights' 'expert' dimension
      (after ep) or their 'model' (d_model) dimension.

    The roles are interpreted by ``moe_praxis.resources`` only: building a MeshConfig builds its
    ``MeshResources`` and checks the roles against the axis names there.
    """

    shape: tuple = (-1, )
    axis_names: tuple = ("data", )
    dp: AxisRole = "data"
    fsdp: AxisRole = None
    ep: AxisRole = None
    tp: AxisRole = None
    fsdp_dim: str = "expert"

    def __post_init__(self):
        shape, names = tuple(self.shape), tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if len(shape) != len(names) or not shape:
            raise _bad("MeshConfig", "shape", shape, f"needs one size per axis name {names}")
        if sum(1 for s in shape if s == -1) > 1:
            raise _bad("MeshConfig", "shape", shape, "at most one axis may be -1")
        for s in shape:
            if not isinstance(s, int) or (s < 1 and s != -1):
                raise _bad("MeshConfig", "shape", shape, "sizes are positive ints or one -1")
        try:
            resources = MeshResources(dp=self.dp,
                                      fsdp=self.fsdp,
                                      ep=self.ep,
                                      tp=self.tp,
                                      fsdp_dim=self.fsdp_dim)
            resources.check_axis_names(names)
        except ValueError as e:
            # The user set these through MeshConfig's fields (--fdl.mesh.ep=...): name them so.
            msg = str(e).replace("MeshResources.", "MeshConfig.")
            raise ValueError(("MeshConfig." if msg.startswith("axis_names=") else "") +
                             msg) from None
        object.__setattr__(self, "_resources", resources)

    @property
    def resources(self) -> MeshResources:
        """The ``moe_praxis.MeshResources`` naming these roles."""
        return self._resources

    def resolved_shape(self, num_devices: int) -> tuple:
        """The shape with -1 replaced; raises if it does not use exactly ``num_devices``."""
        fixed = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if num_devices % fixed:
                raise ValueError(f"MeshConfig.shape={self.shape}: {num_devices} devices are not "
                                 f"divisible by the fixed axes' product {fixed}"
                                 f"{_more_devices(fixed * -(-8 // fixed))}")
            return tuple(num_devices // fixed if s == -1 else s for s in self.shape)
        if fixed != num_devices:
            more = _more_devices(fixed) if fixed > num_devices else ""
            raise ValueError(f"MeshConfig.shape={self.shape} needs {fixed} devices; this job has "
                             f"{num_devices} (use -1 for 'the rest'){more}")
        return self.shape


def _more_devices(n: int) -> str:
    """How to give a job ``n`` devices."""
    return (f"; for {n} devices on the CPU start the job with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}, or run it on {n} GPUs")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    num_steps: train until this step (a resumed run continues to it).
    eval_every: held-out loss and perplexity every this many steps (and at steps 0 and the end).
    eval_batches: held-out batches per evaluation (fixed windows of the held-out split).
    checkpoint_every: orbax checkpoint every this many steps (and at the end and on
      SIGTERM/SIGINT); 0 = only those.
    max_checkpoints: checkpoints kept in job_log_dir/checkpoints.
    seed: parameter-init and dropout seed.
    summary_every: expert-load summaries are recorded every this many steps.
    sigterm_at_step: testing aid: the process sends itself SIGTERM after this step (0 = never),
      so a kill-and-resume test stops at an exact step through the real signal path.
    on_nonfinite: what a step whose loss or gradient norm is not finite does. 'stop': the run
      stops at that step without saving it (the earlier checkpoints stay) and exits with
      status 3. 'skip': the step's update is not applied (parameters, optimizer state and
      non-trainable variables stay as they were; the step's batch is consumed) and the run
      goes on.
    max_skipped_steps: with on_nonfinite='skip', the run stops as 'stop' does when more than
      this many steps in a row were skipped.
    grad_accum_steps: n, micro-batches per optimizer step (gradient accumulation): each step's
      batch (data.batch_size, unchanged) is run as n micro-batches of batch_size / n rows, one
      forward and backward at a time (activation memory of one micro-batch), and the gradients
      summed in float32 before the one optimizer update; loss, metrics, the expert-bias update
      and the expert load are the whole step's. Must divide each data shard's rows
      (batch_size / the devices of the token axes). 1 = the whole batch at once.
    cast_weights_once: the MoE layers' expert weights are cast to the layers' fprop_dtype once
      per step (per micro-batch), outside the scanned layers and their rematerialization,
      instead of at each read (the forward and each recomputation); the same values and
      gradients, for a copy of the expert weights in fprop_dtype held through the step
      (moe_praxis.cast_expert_weights). No effect where fprop_dtype is float32. On by default:
      mixtral_moe_gpu on an H100 ran 218.5 -> 202.9 ms a step, peak 52.3 -> 50.2 GiB
      (benchmarks/results/e2e_h100_step_settings.json).
    eval_on_restore: a run that starts from a checkpoint (resumed, or branched under a changed
      config with --allow_config_change) evaluates the restored state before its first step
      and records it as the eval of that step, under this run's config: the held-out loss of
      the same weights under, say, another precision (benchmarks.fp8_quality's branches).
      metrics.jsonl then holds both evals of that step; read_metrics keeps the later. Off:
      only a run from step 0 evaluates before training.
    """

    num_steps: int = 200
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    max_checkpoints: int = 3
    seed: int = 0
    summary_every: int = 10
    sigterm_at_step: int = 0
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    grad_accum_steps: int = 1
    cast_weights_once: bool = True
    eval_on_restore: bool = False

    def __post_init__(self):
        for name in ("num_steps", "eval_every", "eval_batches", "max_checkpoints", "summary_every",
                     "grad_accum_steps"):
            _positive_int("TrainConfig", name, getattr(self, name))
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise _bad("TrainConfig", "on_nonfinite", self.on_nonfinite,
                       f"valid: {NONFINITE_POLICIES}")
        for name in ("checkpoint_every", "sigterm_at_step", "max_skipped_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise _bad("TrainConfig", name, v, "must be an int >= 0")
        for name in ("cast_weights_once", "eval_on_restore"):
            if not isinstance(getattr(self, name), bool):
                raise _bad("TrainConfig", name, getattr(self, name), "must be True or False")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs. ``model`` is a built Praxis ``TransformerLm`` (unbound)."""

    name: str
    model: Any
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
