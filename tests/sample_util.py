"""Small jobs to sample from (test_sample*.py): a recorded config, the tokenizer copy training
keeps and one checkpoint written from initialised parameters, for each preset family at small
sizes (float32)."""

import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs import experiments as exp
from experiments.job import jobdir
from experiments.train import setup
from experiments.tokenizer import job_copy as tokenizer_copy
from experiments.train.checkpoints import Checkpoints
from experiments.train.steps import make_step_fns


class TinySmall(exp.Tiny):
    NUM_LAYERS = 2
    MODEL_DIMS = 32
    HIDDEN_DIMS = 32
    NUM_HEADS = 2
    NUM_EXPERTS = 4
    SEQ_LEN = 64
    BATCH_SIZE = 8


class _Small:
    VOCAB_SIZE = 256
    MODEL_DIMS = 32
    HIDDEN_DIMS = 64
    MOE_HIDDEN_DIMS = 16
    NUM_HEADS = 2
    DIM_PER_HEAD = 16
    NUM_EXPERTS = 8
    TOP_K = 2
    FPROP_DTYPE = "float32"
    REMAT = False
    SEQ_LEN = 64
    BATCH_SIZE = 8
    MESH_SHAPE = (2, 2, 2)


class DeepSeekSmall(_Small, exp.DeepSeekV3):
    """Dense first layer, then 2 scanned MoE layers: sigmoid scores, 4 groups of which 2 per
    token, expert bias, 1 shared expert, fused gate/up."""
    NUM_LAYERS = 3
    FIRST_K_DENSE = 1
    NUM_EXPERT_GROUPS = 4
    GROUP_TOPK = 2


class Qwen3Small(_Small, exp.Qwen3Moe):
    """2 scanned MoE layers, softmax top-k renormalised, no shared expert; Qwen3's attention
    (grouped-query, per-head q/k norms) with 4 query and 2 key/value heads."""
    NUM_LAYERS = 2
    NUM_HEADS = 4
    NUM_KV_HEADS = 2
    TOP_K = 4


SOFTMAX_SCALE, WEIGHT_SCALE = 4.0, 3.0  # varied, not flat, next tokens
FAMILIES = {"tiny": TinySmall, "deepseek": DeepSeekSmall, "qwen3": Qwen3Small}


def make_job(job_dir,
             family: str,
             *,
             seed: int = 0,
             moe_fields=None,
             step: int = 7,
             mesh=None,
             data=None) -> Path:
    """Writes config.json and the checkpoint of ``step`` into ``job_dir``: initialised
    parameters with the tied embedding scaled up (sharper next-token distributions than at
    initialisation) and, where the layers have one, a random expert bias (routing depends on
    it). moe_fields: MoE layer fields set on the config (e.g. a training capacity_factor);
    mesh: MeshConfig fields (configs.experiments.use_mesh), e.g. {"shape": (1, 1, 1)};
    data: DataConfig fields, e.g. {"path": corpus, "tokenizer": "sp.model"} (the job keeps a copy
    of the tokenizer, as training does)."""
    job_dir = Path(job_dir)
    cfg = FAMILIES[family]().experiment_config()
    if mesh:
        exp.use_mesh(cfg, **mesh)
    for k, v in (data or {}).items():
        setattr(cfg.data, k, v)
    for k, v in (moe_fields or {}).items():
        setattr(
            cfg.model.stacked_transformer_tpl.block if hasattr(
                cfg.model.stacked_transformer_tpl, "block") else cfg.model.stacked_transformer_tpl,
            "moe_layer_tpl", _with(cfg, k, v))
    prep = setup.prepare(cfg, load_data=False)
    fns = make_step_fns(prep)
    key = jax.random.key(seed)
    with jax.set_mesh(prep.mesh):
        state = fns.init(key)

        def perturb(path, x):
            name = jax.tree_util.keystr(path)
            if "softmax" in name:
                return x * SOFTMAX_SCALE
            if jnp.issubdtype(x.dtype, jnp.floating) and "params" in name and x.ndim >= 2:
                return x * WEIGHT_SCALE
            if "expert_bias" in name:
                # crc32, not hash(): the same bias in every process (PYTHONHASHSEED)
                k = jax.random.fold_in(key, zlib.crc32(name.encode()) % (1 << 30))
                return jax.random.normal(k, x.shape, x.dtype) * 0.5
            return x

        state = jax.tree_util.tree_map_with_path(perturb, state)
        ckpts = Checkpoints(job_dir / "checkpoints", 1, fns.abstract_state)
        mngr = ckpts.manager()
        ckpts.save(mngr, jax.device_put(state, fns.state_sharding), step)
        mngr.wait_until_finished()
        mngr.close()
    jobdir.record(job_dir, cfg)
    tokenizer_copy.keep_in_job_dir(job_dir, prep.tokenizer)
    return job_dir


def _with(cfg, k, v):
    from configs import models

    moe = models.stack_block(cfg.model).moe_layer_tpl
    setattr(moe, k, v)
    return moe


def config_json(family: str) -> str:
    """The config.json a job of ``family`` records."""
    from fiddle.experimental import serialization

    return serialization.dump_json(FAMILIES[family]().experiment_config())
