"""The trainer: builds an experiment from its Fiddle config, then trains and evaluates it.

``prepare(cfg)`` validates everything that can be validated without compiling (sub-config
fields, model vs data vs mesh) and returns a ``Prepared`` experiment: the built
``ExperimentConfig``, the device mesh and the sharded model. ``Trainer(prepared,
job_log_dir).run()`` then:

- initialises (or restores, from the latest orbax checkpoint in ``job_log_dir/checkpoints``)
  the state {step, params, opt_state, non_trainable} with explicit shardings: Praxis's
  ``WeightHParams`` split mappings for parameters, the same for the optimizer's moments,
  the batch split over every token axis (dp, fsdp, ep);
- runs ``jax.jit`` train steps: loss = TransformerLm's ``total_loss`` = mean next-byte
  cross-entropy + every aux loss the layers registered (``mutable=[aux_loss, summaries,
  non_trainable]``), global-norm clipping, AdamW;
- every ``eval_every`` steps computes the held-out loss and perplexity;
- writes ``metrics.jsonl`` and TensorBoard events, checkpoints every ``checkpoint_every``
  steps, at the end and on SIGTERM/SIGINT, and draws ``summary.png`` (loss curves and the
  expert-load heatmap, layers x experts) when it finishes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Optional

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax

import moe_praxis  # noqa: F401  (Praxis shims before praxis is imported)
from praxis import base_layer, pax_fiddle, py_utils

from configs import base, models
from experiments import data as data_lib

P = jax.sharding.PartitionSpec
NestedMap = py_utils.NestedMap
MUTABLE = [base_layer.AUX_LOSS, base_layer.SUMMARIES, base_layer.NON_TRAINABLE]
_LOAD_RE = re.compile(r"moe_expert_load_(\d+)_scalar$")
_LAYER_RE = re.compile(r"x_layers_(\d+)$")


class ConfigError(ValueError):
    """An experiment config that cannot run; raised before anything is compiled."""


# ------------------------------------------------------------------------------ prepare


@dataclasses.dataclass
class Prepared:
    config: base.ExperimentConfig  # built; config.model is the (unbound) TransformerLm
    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    model_config: pax_fiddle.Config  # the model config after mesh annotations
    dataset: Any = None  # experiments.data.ByteDataset, read and split
    layout: Any = None  # moe_praxis.EPLayout of the MoE layers (None: data parallel only)

    @property
    def model(self):
        return self.config.model


def _build_part(cfg, field: str):
    part = getattr(cfg, field)
    try:
        return fdl.build(part) if isinstance(part, fdl.Buildable) else part
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--fdl.{field}: {e}") from e


def make_mesh(mesh_cfg: base.MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The device mesh (-1 = the remaining devices) over ``devices`` (default all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_cfg.resolved_shape(len(devices))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), mesh_cfg.axis_names)


def _annotate_model(model_cfg: pax_fiddle.Config, mesh_cfg: base.MeshConfig,
                    mesh_shape: tuple) -> None:
    """Writes the mesh into the model config: Praxis's canonical sharding (weights over fsdp
    and tp, activations' batch over the token axes) and the MoE layers' MeshResources and
    expert-weight layout (expert dim over (ep, fsdp), hidden dim over tp).

    A pure data-parallel mesh needs none of it (weights replicated, batch split by the jit
    input sharding), so nothing is written then. Returns the MoE layers' ``EPLayout`` from
    ``moe_praxis.ep_bootstrap`` (None when nothing was written)."""
    if not (mesh_cfg.fsdp or mesh_cfg.ep or mesh_cfg.tp):
        return None
    from praxis.layers import transformer_models

    def one(axes):
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    dp, fsdp, ep, tp = (one(mesh_cfg.role_axes(r)) for r in ("dp", "fsdp", "ep", "tp"))
    token_axes = mesh_cfg.token_axes()
    transformer_models.TransformerLm.set_sharding_params_v1(model_cfg,
                                                            replica_axis=dp,
                                                            data_axis=fsdp,
                                                            mdl_axis=tp,
                                                            ici_mesh_shape=list(mesh_shape),
                                                            mesh_axis_names=list(
                                                                mesh_cfg.axis_names),
                                                            batch_axes=tuple(token_axes),
                                                            training_optimized=True)
    block = models.stack_block(model_cfg)
    if not block.moe_layers:
        return None
    from moe_praxis import ep_bootstrap

    resources = mesh_cfg.resources()
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), tuple(mesh_cfg.axis_names))
    try:  # resources.py is the one place that interprets the roles
        layout = ep_bootstrap(mesh,
                              resources,
                              block.num_experts,
                              d_model=model_cfg.model_dims,
                              d_ff=block.moe_layer_tpl.hidden_dims or block.hidden_dims)
    except ValueError as e:
        raise ConfigError(f"--fdl.mesh: {e}") from e
    specs = layout.weight_specs
    moe = block.moe_layer_tpl
    moe.mesh_resources = resources
    moe.weight_split_dims_mapping.me = list(specs["router"])
    moe.weight_split_dims_mapping.emh = list(specs["wi_up"])
    moe.weight_split_dims_mapping.ehm = list(specs["wo"])
    return layout


def _validate(exp: base.ExperimentConfig, model_cfg, mesh_shape: tuple) -> None:
    """Cross-part checks (each part validated its own fields when built)."""
    lm = model_cfg
    block = models.stack_block(lm)
    nl = models.num_layers(lm)
    if lm.vocab_size < data_lib.VOCAB_SIZE:
        raise ConfigError(f"--fdl.model.vocab_size={lm.vocab_size} is invalid: byte-level data "
                          f"needs at least {data_lib.VOCAB_SIZE}")
    if block.dim_per_head is None and lm.model_dims % block.num_heads:
        raise ConfigError(f"model_dims={lm.model_dims} is not divisible by num_heads="
                          f"{block.num_heads} (or set dim_per_head)")
    bad = [i for i in (block.moe_layers or []) if not 0 <= i < block.num_layers]
    if bad:
        raise ConfigError(f"moe_layers={list(block.moe_layers)} has indices {bad} outside "
                          f"[0, num_layers={block.num_layers})")
    if block.moe_layers:
        k = block.moe_layer_tpl.num_experts_per_token
        if not 1 <= k <= block.num_experts:
            raise ConfigError(f"num_experts_per_token={k} must be in [1, num_experts="
                              f"{block.num_experts}]")
    # (experts vs the ep size and every other role check: ep_bootstrap, in _annotate_model)
    sizes = dict(zip(exp.mesh.axis_names, mesh_shape))
    tokens = math.prod(sizes[a] for a in exp.mesh.token_axes())
    if exp.data.batch_size % tokens:
        raise ConfigError(f"--fdl.data.batch_size={exp.data.batch_size} is not divisible by the "
                          f"{tokens} devices of the token axes {exp.mesh.token_axes()} of mesh "
                          f"{sizes}")
    if nl < 1:
        raise ConfigError(f"the model has {nl} layers; it needs at least 1")


def prepare(cfg: pax_fiddle.Config, *, devices=None) -> Prepared:
    """Validates and builds an experiment config and reads its data. No tracing, no
    compilation. Raises ConfigError naming the problem.

    devices: the devices of the mesh (default: all, over every process; fake host devices
      for ``experiments.validate``).
    """
    if not isinstance(cfg, fdl.Buildable) or cfg.__fn_or_cls__ is not base.ExperimentConfig:
        got = getattr(cfg, "__fn_or_cls__", type(cfg))
        raise ConfigError(f"the experiment config must be a Config of "
                          f"configs.base.ExperimentConfig, got one of {got!r}")
    cfg = copy.deepcopy(cfg)
    parts = {f: _build_part(cfg, f) for f in ("data", "optimizer", "mesh", "train")}
    mesh_cfg = parts["mesh"]
    try:
        mesh = make_mesh(mesh_cfg, devices)
    except ValueError as e:
        raise ConfigError(f"--fdl.mesh: {e}") from e
    mesh_shape = tuple(mesh.devices.shape)
    model_cfg = cfg.model
    if not isinstance(model_cfg, pax_fiddle.Config):
        raise ConfigError(f"--fdl.model must be a pax_fiddle.Config of a TransformerLm, got "
                          f"{type(model_cfg).__name__}")
    exp_stub = base.ExperimentConfig(name=cfg.name, model=None, **parts)
    layout = _annotate_model(model_cfg, mesh_cfg, mesh_shape)
    _validate(exp_stub, model_cfg, mesh_shape)
    try:
        model = pax_fiddle.build(model_cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--fdl.model: {e}") from e
    exp = dataclasses.replace(exp_stub, model=model)
    try:
        dataset = data_lib.load_dataset(exp.data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--fdl.data: {e}") from e
    return Prepared(config=exp, mesh=mesh, model_config=model_cfg, dataset=dataset, layout=layout)


# ------------------------------------------------------------------------ model functions


def _model_inputs(batch):
    ids = batch["ids"]
    paddings = jnp.zeros(ids.shape, jnp.float32)
    labels = NestedMap(class_ids=batch["labels"], class_weights=batch["weights"])
    return ids, paddings, labels


def make_optimizer(opt: base.OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) -> AdamW(schedule). Returns (transformation, schedule)."""
    decay = opt.decay_steps or num_steps
    lr, w = opt.learning_rate, opt.warmup_steps
    if opt.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, max(decay - w, 1), alpha=opt.end_lr_fraction)
    else:
        after = optax.linear_schedule(lr, lr * opt.end_lr_fraction, max(decay - w, 1))
    # Linear warmup from 0 over w steps, then the decay over the remaining decay - w steps.
    sched = after if w == 0 else optax.join_schedules([optax.linear_schedule(0.0, lr, w), after],
                                                      [w])
    chain = [optax.clip_by_global_norm(opt.clip_norm)] if opt.clip_norm > 0 else []
    chain.append(
        optax.adamw(sched, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay))
    return optax.chain(*chain), sched


def _flat_summaries(tree, prefix=()):
    if isinstance(tree, dict) or hasattr(tree, "items"):
        for k, v in tree.items():
            yield from _flat_summaries(v, prefix + (str(k), ))
    else:
        yield prefix, tree


def expert_load(summaries, num_layers: int, layers_per_block: int = 1):
    """[num_layers, E] fraction of routed token copies per expert, from the layers'
    ``moe_expert_load_{e}`` summaries (rows of dense layers are NaN); None if there are none.

    StackedTransformer: layer l's summaries sit under ``x_layers_{l}``. The repeated stack
    stacks its block's summaries along a leading repeat dimension: layer = repeat index *
    layers_per_block + the index inside the block."""
    found = {}
    for path, v in _flat_summaries(summaries):
        m = _LOAD_RE.search(path[-1])
        if not m:
            continue
        e = int(m.group(1))
        inner = next((int(_LAYER_RE.match(p).group(1)) for p in path if _LAYER_RE.match(p)), 0)
        vals = jnp.asarray(v, jnp.float32).reshape(-1)
        if vals.shape[0] == 1:
            found[(inner, e)] = vals[0]
        else:
            for r in range(vals.shape[0]):
                found[(r * layers_per_block + inner, e)] = vals[r]
    if not found:
        return None
    num_e = max(e for _, e in found) + 1
    rows = [[found.get((li, e), jnp.float32(jnp.nan)) for e in range(num_e)]
            for li in range(num_layers)]
    return jnp.asarray(rows, jnp.float32)


@dataclasses.dataclass
class StepFns:
    init: Any
    train: Any
    eval: Any
    state_sharding: Any
    batch_sharding: Any
    abstract_state: Any
    schedule: Any


def make_step_fns(prep: Prepared) -> StepFns:
    """Jitted init / train / eval with explicit shardings (nothing is compiled yet)."""
    exp, model, mesh = prep.config, prep.model, prep.mesh
    nl = models.num_layers(prep.model_config)
    lpb = models.stack_block(prep.model_config).num_layers
    tx, schedule = make_optimizer(exp.optimizer, exp.train.num_steps)
    b, s = exp.data.batch_size, exp.data.seq_len
    # The batch is split over the token axes exactly as the MoE block splits its tokens.
    token_axes = prep.layout.token_axes if prep.layout is not None else exp.mesh.token_axes()
    batch_spec = P(token_axes if token_axes else None, None)
    batch_sharding = jax.sharding.NamedSharding(mesh, batch_spec)
    fake = {
        "ids": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "labels": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "weights": jax.ShapeDtypeStruct((b, s), jnp.float32)
    }

    def init_fn(key):
        ids, paddings, labels = _model_inputs({
            k: jnp.zeros(v.shape, v.dtype)
            for k, v in fake.items()
        })
        k1, k2 = jax.random.split(key)
        variables = model.init({
            base_layer.PARAMS: k1,
            base_layer.RANDOM: k2
        },
                               ids,
                               paddings,
                               labels=labels)
        params = variables[base_layer.PARAMS]
        rest = {k: v for k, v in variables.items() if k == base_layer.NON_TRAINABLE}
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "non_trainable": rest
        }

    # Shardings: Praxis's WeightHParams split mappings when the model has a mesh, else
    # replicated parameters.
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init_fn, jax.random.key(0))
    if getattr(model, "ici_mesh_shape", None) is not None:
        ids, paddings, labels = _model_inputs(fake)
        with jax.set_mesh(mesh):
            var_hparams = model.abstract_init_with_metadata(ids, paddings, labels=labels)
        specs = base_layer.var_partition_specs(var_hparams,
                                               mesh_shape=model.ici_mesh_shape,
                                               device_axis_names=model.mesh_axis_names)
        param_specs = specs[base_layer.PARAMS]
        nt_specs = {k: specs[k] for k in abstract["non_trainable"]}
    else:
        param_specs = jax.tree_util.tree_map(lambda _: P(), abstract["params"])
        nt_specs = jax.tree_util.tree_map(lambda _: P(), abstract["non_trainable"])
    opt_specs = optax.tree_map_params(tx,
                                      lambda _, spec: spec,
                                      abstract["opt_state"],
                                      param_specs,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda x: isinstance(x, P))
    specs = {"step": P(), "params": param_specs, "opt_state": opt_specs, "non_trainable": nt_specs}
    state_sharding = jax.tree_util.tree_map(lambda sp: jax.sharding.NamedSharding(mesh, sp),
                                            specs,
                                            is_leaf=lambda x: isinstance(x, P))
    replicated = jax.sharding.NamedSharding(mesh, P())

    def loss_fn(params, non_trainable, batch, key, do_eval):
        ids, paddings, labels = _model_inputs(batch)
        ctx = base_layer.JaxContext.HParams(do_eval=do_eval)
        with base_layer.JaxContext.new_context(hparams=ctx):
            out, updated = model.apply({
                base_layer.PARAMS: params,
                **non_trainable
            },
                                       ids,
                                       paddings,
                                       labels=labels,
                                       rngs={base_layer.RANDOM: key},
                                       mutable=MUTABLE)
        return out.total_loss, (out, updated)

    def train_fn(state, batch):
        step = state["step"]
        key = jax.random.fold_in(jax.random.key(exp.train.seed + 1), step)
        (loss, (out, updated)), grads = jax.value_and_grad(loss_fn,
                                                           has_aux=True)(state["params"],
                                                                         state["non_trainable"],
                                                                         batch, key, False)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        nt = {k: updated.get(k, v) for k, v in state["non_trainable"].items()}
        metrics = {
            "loss": loss,
            "xent": out.avg_xent,
            "aux_loss": out.get("aux_loss", jnp.zeros(())),
            "grad_norm": optax.global_norm(grads),
            "learning_rate": schedule(step),
        }
        load = expert_load(updated.get(base_layer.SUMMARIES, {}), nl, lpb)
        if load is not None:
            metrics["expert_load"] = load
        new_state = {
            "step": step + 1,
            "params": params,
            "opt_state": opt_state,
            "non_trainable": nt
        }
        return new_state, metrics

    def eval_fn(state, batch):
        loss, (out, _) = loss_fn(state["params"], state["non_trainable"], batch, jax.random.key(0),
                                 True)
        return {"xent": out.avg_xent}

    init = jax.jit(init_fn, out_shardings=state_sharding)
    train = jax.jit(train_fn,
                    in_shardings=(state_sharding, batch_sharding),
                    out_shardings=(state_sharding, replicated),
                    donate_argnums=0)
    evaluate = jax.jit(eval_fn,
                       in_shardings=(state_sharding, batch_sharding),
                       out_shardings=replicated)
    abstract_state = jax.tree_util.tree_map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, state_sharding)
    return StepFns(init=init,
                   train=train,
                   eval=evaluate,
                   state_sharding=state_sharding,
                   batch_sharding=batch_sharding,
                   abstract_state=abstract_state,
                   schedule=schedule)


def put_batch(batch: dict, sharding) -> dict:
    """Global numpy batch -> global jax arrays; each process fills only its own shards."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items()
    }


# ----------------------------------------------------------------------------- logging


class MetricsWriter:
    """metrics.jsonl + TensorBoard events, written by process 0 only."""

    def __init__(self, job_log_dir: Path, enabled: bool):
        self.enabled = enabled
        self.path = job_log_dir / "metrics.jsonl"
        self.tb_dir = job_log_dir / "tensorboard"
        self._file = None
        self._tb = None
        if enabled:
            job_log_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), "time": time.time()}
        for k, v in values.items():
            v = np.asarray(v)
            rec[k] = v.tolist() if v.ndim else float(v)
            if v.ndim == 0:
                self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
            elif v.ndim == 2:  # the [layers, experts] load as a grey image (white = max)
                img = np.nan_to_num(v.astype(np.float32))
                self._tb.add_image(f"{kind}/{k}",
                                   img / max(float(img.max()), 1e-9),
                                   int(step),
                                   dataformats="HW")
        self._file.write(json.dumps(rec) + "\n")

    def close(self):
        if self.enabled:
            self._file.close()
            self._tb.flush()
            self._tb.close()


def read_metrics(path) -> list[dict]:
    """metrics.jsonl records, keeping the LAST record of each (kind, step) (a restarted run may
    repeat steps done after its last checkpoint), sorted by step."""
    latest = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                latest[(rec["kind"], rec["step"])] = rec
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"]))


def plot_summary(metrics_path, png_path, title: str = "") -> Path:
    """Loss curves (train xent, held-out loss) and the expert-load heatmap (layers x experts,
    fraction of routed token copies, latest record) from metrics.jsonl, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    loads = [r for r in recs if r["kind"] == "expert_load"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["xent"] for r in train],
                lw=0.8,
                label="train cross-entropy")
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_loss"] for r in ev],
                "o-",
                label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / byte")
    ax.set_title(f"{title} loss".strip())
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    if loads:
        mat = np.array(loads[-1]["load"], dtype=float)
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
        if mat.shape[0] <= 64:
            ax.set_yticks(range(mat.shape[0]))
        if mat.shape[1] <= 32:
            ax.set_xticks(range(mat.shape[1]))
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(f"expert load at step {loads[-1]['step']} (fraction of routed tokens)")
        fig.colorbar(im, ax=ax)
    else:
        ax.text(0.5, 0.5, "no expert-load summaries", ha="center", va="center")
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


# ------------------------------------------------------------------------------ trainer


class Trainer:
    """Runs one prepared experiment in ``job_log_dir`` (resuming from its checkpoints)."""

    def __init__(self, prep: Prepared, job_log_dir, *, progress: bool = True):
        self.prep = prep
        self.exp = prep.config
        self.job_log_dir = Path(job_log_dir).absolute()
        self.is_chief = jax.process_index() == 0
        self.progress = progress and self.is_chief
        self.fns = make_step_fns(prep)
        self.dataset = prep.dataset or data_lib.load_dataset(self.exp.data)
        self._stop_signal = None
        self.ckpt_dir = self.job_log_dir / "checkpoints"
        self.png_path = self.job_log_dir / "summary.png"

    # -- checkpoints
    def _manager(self):
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=self.exp.train.max_checkpoints, create=True)
        return ocp.CheckpointManager(self.ckpt_dir, options=opts)

    def _save(self, mngr, state, step: int):
        import orbax.checkpoint as ocp

        if mngr.latest_step() == step:
            return
        mngr.save(step, args=ocp.args.StandardSave(state), force=True)

    def _restore_or_init(self, mngr):
        latest = mngr.latest_step()
        if latest is None:
            return self.fns.init(jax.random.key(self.exp.train.seed)), None
        return self._restore(mngr, latest), latest

    def _restore(self, mngr, step: int):
        import orbax.checkpoint as ocp

        try:
            return mngr.restore(step, args=ocp.args.StandardRestore(self.fns.abstract_state))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"the checkpoint of step {step} in {self.ckpt_dir} does not fit this "
                f"experiment's state (written by a different model or optimizer config?); use "
                f"another --job_log_dir. orbax said: {e}") from e

    # -- signals
    def _on_signal(self, signum, frame):
        self._stop_signal = signum

    def _evaluate(self, state, eval_batches) -> dict:
        xs = [float(self.fns.eval(state, b)["xent"]) for b in eval_batches]
        loss = float(np.mean(xs))
        return {"heldout_loss": loss, "heldout_perplexity": math.exp(min(loss, 700.0))}

    def evaluate_latest(self) -> dict:
        """Held-out loss and perplexity of the latest checkpoint (``--mode=eval``)."""
        mngr = self._manager()
        try:
            step = mngr.latest_step()
            if step is None:
                raise FileNotFoundError(f"--mode=eval needs a checkpoint; {self.ckpt_dir} has "
                                        "none (train first, or point --job_log_dir at a run)")
            with jax.set_mesh(self.prep.mesh):
                state = self._restore(mngr, step)
                batches = [
                    put_batch(b, self.fns.batch_sharding)
                    for b in self.dataset.eval_batches(self.exp.train.eval_batches)
                ]
                result = {"step": step, **self._evaluate(state, batches)}
        finally:
            mngr.close()
        return result

    def run(self) -> dict:
        """Trains to ``train.num_steps`` (or until SIGTERM/SIGINT). Returns a summary dict:
        start_step, final_step, stopped_by (None or the signal name), last train and eval
        metrics, and the paths written."""
        exp, tr = self.exp, self.exp.train
        writer = MetricsWriter(self.job_log_dir, self.is_chief)
        mngr = self._manager()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        result = {
            "job_log_dir": str(self.job_log_dir),
            "metrics": str(writer.path),
            "tensorboard": str(writer.tb_dir),
            "checkpoints": str(self.ckpt_dir),
            "plot": str(self.png_path),
            "stopped_by": None,
            "last_eval": None
        }
        try:
            with jax.set_mesh(self.prep.mesh):
                state, restored = self._restore_or_init(mngr)
                start = int(jax.device_get(state["step"]))
                result["start_step"] = start
                result["restored_from"] = restored
                eval_batches = [
                    put_batch(b, self.fns.batch_sharding)
                    for b in self.dataset.eval_batches(tr.eval_batches)
                ]
                if start == 0:
                    ev = self._evaluate(state, eval_batches)
                    writer.write("eval", 0, ev)
                    result["first_eval"] = ev
                tokens = exp.data.batch_size * exp.data.seq_len
                train_step = self.fns.train
                if start < tr.num_steps:  # compile ahead, so tokens/s is the step's own
                    t0 = time.perf_counter()
                    train_step = self.fns.train.lower(
                        state, put_batch(self.dataset.train_batch(start),
                                         self.fns.batch_sharding)).compile()
                    result["compile_seconds"] = time.perf_counter() - t0
                bar = None
                if self.progress and start < tr.num_steps:
                    from tqdm import tqdm

                    bar = tqdm(total=tr.num_steps,
                               initial=start,
                               desc=exp.name,
                               unit="step",
                               dynamic_ncols=True)
                step = start
                last = {}
                t_prev = time.perf_counter()
                while step < tr.num_steps and self._stop_signal is None:
                    batch = put_batch(self.dataset.train_batch(step), self.fns.batch_sharding)
                    state, metrics = train_step(state, batch)
                    metrics = jax.device_get(metrics)
                    step += 1
                    now = time.perf_counter()
                    tps = tokens / max(now - t_prev, 1e-9)
                    t_prev = now
                    load = metrics.pop("expert_load", None)
                    last = {k: float(v) for k, v in metrics.items()}
                    last["tokens_per_sec"] = tps
                    writer.write("train", step, last)
                    if load is not None and (step % tr.summary_every == 0 or step == tr.num_steps):
                        writer.write("expert_load", step, {"load": np.asarray(load)})
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tps:,.0f}")
                    if step % tr.eval_every == 0 or step == tr.num_steps:
                        ev = self._evaluate(state, eval_batches)
                        writer.write("eval", step, ev)
                        result["last_eval"] = ev
                        if bar is not None:
                            bar.write(f"step {step}: held-out loss {ev['heldout_loss']:.4f}, "
                                      f"perplexity {ev['heldout_perplexity']:.3f}")
                    if tr.checkpoint_every and step % tr.checkpoint_every == 0:
                        self._save(mngr, state, step)
                    if tr.sigterm_at_step and step == tr.sigterm_at_step:
                        os.kill(os.getpid(), signal.SIGTERM)
                if bar is not None:
                    bar.close()
                self._save(mngr, state, step)
                mngr.wait_until_finished()
                result["final_step"] = step
                result["last_train"] = last
                if self._stop_signal is not None:
                    result["stopped_by"] = signal.Signals(self._stop_signal).name
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            mngr.close()
            writer.close()
        if self.is_chief and result["stopped_by"] is None and writer.path.exists():
            plot_summary(writer.path, self.png_path, title=exp.name)
        return result
