"""Setting an experiment up: validate and build its Fiddle config, make the device mesh.

``prepare(cfg)`` validates everything that can be validated without compiling (sub-config
fields, model vs data vs mesh) and returns a ``Prepared`` experiment: the built
``ExperimentConfig``, the device mesh and the sharded model. ``experiments.train.loop.Trainer`` runs
it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import fiddle as fdl
import jax
import numpy as np

import moe_praxis  # (also: Praxis shims before praxis is imported)
from praxis import pax_fiddle

from configs import base, models, sharding, stack
from experiments import data as data_lib
from experiments.train import microbatch
from experiments import tokenizer as tokenizer_lib
from experiments.tokenizer import job_copy as tokenizer_copy


class ConfigError(ValueError):
    """An experiment config that cannot run; raised before anything is compiled."""


class DataError(ConfigError):
    """Data that cannot be used (a missing or unreadable file, a tokenizer file that does not
    load, a corpus too small for one example) under a config that may be fine: its message
    names the file or ``data.`` field."""


# ------------------------------------------------------------------ lengths from num_steps


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def resolve_lengths(cfg, recorded=None) -> None:
    """Fixes, in ``cfg``, every length derived from ``train.num_steps`` when the job starts:
    ``optimizer.decay_steps=0`` becomes the schedule's length, ``recorded``'s (the job
    directory's record, which keeps its first start's value) or else this start's
    ``train.num_steps``. Training records it, so a resumed run keeps the schedule of the steps it
    already took: raising ``train.num_steps`` continues at the schedule's end value, and a
    different ``decay_steps`` given explicitly is a config change the job directory reports.
    An old record whose ``decay_steps`` is still 0 is resolved the same way, in memory."""

    def length(c):
        opt, train = getattr(c, "optimizer", None), getattr(c, "train", None)
        if isinstance(opt, fdl.Buildable) and isinstance(train, fdl.Buildable) and \
                opt.decay_steps == 0 and _positive_int(train.num_steps):
            return opt, train.num_steps
        return opt, None  # (a bad num_steps is reported as train.num_steps when train is built)

    if recorded is not None:
        opt, steps = length(recorded)
        if steps is not None:
            opt.decay_steps = steps
    opt, steps = length(cfg)
    if steps is not None:
        rec_opt = getattr(recorded, "optimizer", None)
        opt.decay_steps = getattr(rec_opt, "decay_steps", 0) or steps


# ------------------------------------------------------------------------------ prepare


@dataclasses.dataclass
class Prepared:
    config: base.ExperimentConfig  # built; config.model is the (unbound) TransformerLm
    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    model_config: pax_fiddle.Config  # the model config, sharded by the experiment config
    dataset: Any = None  # experiments.data.ByteDataset or pipeline.TokenDataset, read and split
    tokenizer: Any = None  # experiments.tokenizer.Tokenizer
    layout: Any = None  # moe_praxis.EPLayout of the MoE layers (None: data parallel only)

    @property
    def model(self):
        return self.config.model


def _build_part(cfg, field: str):
    part = getattr(cfg, field)
    try:
        return fdl.build(part) if isinstance(part, fdl.Buildable) else part
    except (TypeError, ValueError) as e:
        # Fiddle appends a "Fiddle context" naming every argument of the failed call, derived
        # ones too (optimizer.decay_steps): the error names only what was wrong.
        why = str(e).split("\n\nFiddle context:")[0]
        raise ConfigError(f"--fdl.{field}: {why}") from e


def make_mesh(mesh_cfg: base.MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The device mesh (-1 = the remaining devices) over ``devices`` (default all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_cfg.resolved_shape(len(devices))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), mesh_cfg.axis_names)


def _fits(written, shape: tuple) -> bool:
    """Whether a model's ici_mesh_shape describes ``shape`` (a -1 stands for any size)."""
    return written is not None and len(written) == len(shape) and all(
        w in (-1, s) for w, s in zip(written, shape))


def _fill_mesh_shape(node, written: list, shape: list) -> None:
    """Replaces ``written`` (a mesh shape with a -1) by the resolved ``shape`` in every
    ``ici_mesh_shape`` of a model config: Praxis copies the shape into each sub-layer."""
    if isinstance(node, fdl.Buildable):
        if "ici_mesh_shape" in node.__arguments__ and node.ici_mesh_shape is not None and list(
                node.ici_mesh_shape) == written:
            node.ici_mesh_shape = list(shape)
        children = node.__arguments__.values()
    elif isinstance(node, (list, tuple)):
        children = node
    elif isinstance(node, dict):
        children = node.values()
    else:
        return
    for child in children:
        _fill_mesh_shape(child, written, shape)


def _check_sharding(model_cfg: pax_fiddle.Config, mesh_cfg: base.MeshConfig, mesh_shape: tuple):
    """Checks the sharding that the experiment config wrote into the model
    (``configs.sharding.annotate``) against the mesh, fills a -1 of its mesh shape in, and
    validates the MoE layers' roles on the real mesh with ``moe_praxis.ep_bootstrap`` (the one
    call per built step). Apart from the size of a -1 axis, nothing the config wrote is
    changed, so ``--fdl`` overrides of sharding fields stand. Returns the MoE layers' ``EPLayout`` (None without one)."""
    sizes = dict(zip(mesh_cfg.axis_names, mesh_shape))
    fix = ("the model's sharding is written when the experiment config is built; set the mesh "
           "with a fiddler (--fiddler='use_mesh(shape=..., ep=...)', use_expert_parallel, "
           "use_fsdp_expert_parallel) or an experiment's MESH_* knobs, not --fdl.mesh overrides")
    written = model_cfg.mesh_axis_names
    if written is None:
        if sharding.is_sharded(mesh_cfg):
            raise ConfigError(f"--fdl.mesh: mesh {sizes} shards over fsdp, ep or tp but the "
                              f"model carries no sharding: {fix}")
        return None
    same_axes = tuple(written) == tuple(mesh_cfg.axis_names)
    if not same_axes or not _fits(model_cfg.ici_mesh_shape, mesh_shape):
        raise ConfigError(f"--fdl.mesh: the model is sharded for mesh axes {list(written)} of "
                          f"shape {model_cfg.ici_mesh_shape}, the experiment's mesh is {sizes}: "
                          f"{fix}")
    if list(model_cfg.ici_mesh_shape) != list(mesh_shape):
        _fill_mesh_shape(model_cfg, list(model_cfg.ici_mesh_shape), list(mesh_shape))
    block = models.stack_block(model_cfg)
    if not block.moe_layers:
        return None
    moe_resources = block.moe_layer_tpl.mesh_resources
    try:
        if isinstance(moe_resources, fdl.Buildable):
            moe_resources = fdl.build(moe_resources)
    except ValueError as e:
        raise ConfigError(f"the MoE layers' mesh_resources: {e}") from e
    if moe_resources != mesh_cfg.resources:
        raise ConfigError(f"--fdl.mesh: the MoE layers' mesh_resources {moe_resources} are not "
                          f"the mesh's {mesh_cfg.resources}: {fix}")
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), tuple(mesh_cfg.axis_names))
    moe = block.moe_layer_tpl
    d_ff = moe.hidden_dims or block.hidden_dims
    shared_d_ff = (moe.shared_hidden_dims or moe.num_shared_experts * d_ff
                   if moe.num_shared_experts else None)
    try:  # resources.py is the one place that interprets the roles
        return moe_praxis.ep_bootstrap(mesh,
                                       mesh_cfg.resources,
                                       block.num_experts,
                                       d_model=model_cfg.model_dims,
                                       d_ff=d_ff,
                                       shared_d_ff=shared_d_ff)
    except ValueError as e:
        raise ConfigError(f"--fdl.mesh: {e}") from e


def _validate(exp: base.ExperimentConfig, model_cfg, mesh_shape: tuple) -> None:
    """Cross-part checks (each part validated its own fields when built)."""
    lm = model_cfg
    block = models.stack_block(lm)
    nl = models.num_layers(lm)
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
    # (experts vs the ep size and every other role check: ep_bootstrap, in _check_sharding)
    sizes = dict(zip(exp.mesh.axis_names, mesh_shape))
    token_axes = exp.mesh.resources.token_axes
    tokens = math.prod(sizes[a] for a in token_axes)
    if exp.data.batch_size % tokens:
        raise ConfigError(f"--fdl.data.batch_size={exp.data.batch_size} is not divisible by the "
                          f"{tokens} devices of the token axes {token_axes} of mesh "
                          f"{sizes}")
    if nl < 1:
        raise ConfigError(f"the model has {nl} layers; it needs at least 1")
    n = exp.train.grad_accum_steps
    why = microbatch.check(exp.data.batch_size, n, tokens)
    if why:
        raise ConfigError(why)
    try:
        if n > 1:
            microbatch.bias_rule(lm)
    except ValueError as e:
        raise ConfigError(str(e)) from e


VOCAB_MULTIPLE = 128  # a vocabulary taken from the tokenizer is rounded up to a multiple of it


def _set_vocab(model_cfg, data_cfg: base.DataConfig, job_log_dir, tokenizer_given: bool = True):
    """The tokenizer and the model's vocabulary: the tokenizer's rounded up to
    ``VOCAB_MULTIPLE`` when the experiment leaves ``model.vocab_size`` unset; a set one must
    hold the tokenizer. Where the job directory keeps a tokenizer copy, it is used when the
    tokenizer was not given by the user (``tokenizer_given=False``) or its original file is
    gone; a tokenizer given must be the kept one."""
    spec = data_cfg.tokenizer
    try:
        kept = tokenizer_copy.job_tokenizer_path(job_log_dir) if job_log_dir is not None else None
        if kept is not None and spec != tokenizer_lib.BYTES and (
                not tokenizer_given or not Path(spec).expanduser().exists()):
            tok = tokenizer_copy.job_tokenizer(job_log_dir)  # checked against its hash
        else:
            tok = tokenizer_lib.load_tokenizer(spec)
            if job_log_dir is not None:
                tokenizer_copy.check_job_tokenizer(job_log_dir, tok)
    except ValueError as e:
        raise DataError(str(e)) from e
    if model_cfg.vocab_size is None:
        model_cfg.vocab_size = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        model_cfg.softmax_tpl.num_classes = model_cfg.vocab_size
    elif model_cfg.vocab_size < tok.vocab_size:
        raise ConfigError(f"--fdl.model.vocab_size={model_cfg.vocab_size} is smaller than the "
                          f"tokenizer {tok.name}'s vocabulary of {tok.vocab_size}; raise it or "
                          "leave it unset (the model then takes the tokenizer's, rounded up to a "
                          f"multiple of {VOCAB_MULTIPLE})")
    return tok


def describe_data(dataset, vocab_size: int) -> str:
    """The startup line's account of the data."""
    i = dataset.info
    where = f" {i['path']}" if i.get("path") else ""
    skipped = f" ({i['skipped_files']} other files left out)" if i.get("skipped_files") else ""
    return (f"data: source {i['source']}{where}, {i['files']} files{skipped}, "
            f"{i['documents']:,} documents, {i['tokens']:,} tokens ({i['bytes']:,} bytes), "
            f"tokenizer {i['tokenizer']} ({i['tokenizer_vocab']:,} ids), model vocabulary "
            f"{vocab_size:,}, packing {i['packing']}" +
            (f"; cache {i['cache']}" if i.get("cache") else ""))


def prepare(cfg: pax_fiddle.Config,
            *,
            devices=None,
            job_log_dir=None,
            progress: bool = False,
            load_data: bool = True,
            tokenizer_given: bool = True) -> Prepared:
    """Validates and builds an experiment config and reads its data. No tracing, no
    compilation. Raises ConfigError naming the problem.

    devices: the devices of the mesh (default: all, over every process; fake host devices
      for ``experiments.validate``).
    job_log_dir: the job directory; a tokenizer it keeps must be the one the config names.
    tokenizer_given: False where the config's ``data.tokenizer`` is the job directory's recorded
      one, not one the user gave (eval, resume and sampling of a job as it is): the job's
      checksummed copy is used, whatever the original path holds now.
    progress: draw the tokenizing progress bar (a corpus not yet in the cache).
    load_data: read the dataset (sampling does not need it: ``Prepared.dataset`` stays None).
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
    tok = _set_vocab(model_cfg, parts["data"], job_log_dir, tokenizer_given)
    # Packed documents: cuDNN attention runs its packed-segments route (moe_praxis.attention).
    models.set_attention(model_cfg, packed_input=parts["data"].packing == "documents")
    try:  # what Praxis would assert or overwrite, and the MoE layers' fields, before tracing
        stack.check(model_cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    exp_stub = base.ExperimentConfig(name=cfg.name, model=None, **parts)
    layout = _check_sharding(model_cfg, mesh_cfg, mesh_shape)
    _validate(exp_stub, model_cfg, mesh_shape)
    try:
        model = pax_fiddle.build(model_cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--fdl.model: {e}") from e
    exp = dataclasses.replace(exp_stub, model=model)
    if not load_data:
        return Prepared(config=exp, mesh=mesh, model_config=model_cfg, layout=layout, tokenizer=tok)
    try:
        dataset = data_lib.load_dataset(exp.data, tok, progress=progress)
    except (OSError, ValueError) as e:
        raise DataError(str(e)) from e
    return Prepared(config=exp,
                    mesh=mesh,
                    model_config=model_cfg,
                    dataset=dataset,
                    layout=layout,
                    tokenizer=tok)
