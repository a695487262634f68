"""The registered experiments and their presets.

Each experiment is a class of UPPERCASE knobs (PaxML style); ``experiment_config()`` turns the
knobs into one ``pax_fiddle.Config(ExperimentConfig, ...)``. Subclass to change knobs, or
override any leaf of the returned config from the command line with ``--fdl.X=value``.

The module-level functions (``tiny()``, ``small_gpu()``, ...) return the same configs for
Fiddle's ``--fdl_config=NAME`` flag: one per registered experiment, made from the registry at
the end of this module (``configs.registry.define_config_functions``).

Presets:
  Tiny          ~1M params; trains on a laptop CPU in about a minute (the ``make run`` default).
  SmallGpu      ~0.4B params (8 experts, 8 layers); one GPU.
  Mixtral8x7B   Mixtral-8x7B layer shapes (M=4096, H=14336, E=8, k=2, 32 layers, 32 query
                heads and 8 key/value heads, rotary base 1e6, vocab 32000); 64 GPUs as dp2 x fsdp4 x ep8 (fsdp on d_model).
  DeepSeekV3    DeepSeek-V3 (M=7168, expert H=2048, E=256, k=8, 61 layers of which the first
                3 dense, 128 heads of 128, vocab 129280; sigmoid group-limited routing with
                the trained expert bias, 1 shared expert; plain multi-head attention stands
                in for its MLA); 256 GPUs as fsdp8 x ep32.
  Qwen3Moe      Qwen3-30B-A3B's MoE (M=2048, E=128 of H=768, k=8, softmax with norm_topk,
                no shared expert, 48 layers; 32 query heads and 4 key/value heads of 128 with
                per-head q/k RMSNorm, rotary base 1e6); 32 GPUs as fsdp4 x ep8.

Data: ``data.path`` (documents) through ``data.tokenizer`` ('bytes', a SentencePiece or Hugging
Face tokenizer file); by default every preset trains on pydoc's text as bytes. The presets
named after real models keep their real vocabularies: give their family's tokenizer to train
them on text.
"""

from __future__ import annotations

from typing import Optional, Sequence

import fiddle as fdl
from praxis import pax_fiddle

from configs import base, models, sharding
from configs.fiddlers import (  # noqa: F401  (--fiddler=NAME resolves here)
    use_expert_parallel, use_fsdp_expert_parallel, use_mesh, use_synthetic_data)
from configs.registry import define_config_functions, register, short_name
from moe_praxis.praxis.fields import config_default

# The MoEFeedForward fields an experiment sets by a knob of the same name in capitals
# (LanguageModel.SCORE_FUNC, ...), passed to models.transformer_lm as moe_fields.
MOE_KNOBS = ("score_func", "norm_topk", "num_expert_groups", "group_topk", "use_expert_bias",
             "expert_bias_update_rate", "routed_scaling_factor", "num_shared_experts",
             "shared_hidden_dims", "fp8", "fp8_gemms", "regather_rows", "router_z_loss_weight")
# The MoEFeedForward fields of the layer's own (not MoEConfig's) set the same way, each
# starting from the layer's default.
LAYER_KNOBS = ("router_init_scale", )


class LanguageModel:
    """Base class of the MoE language-model experiments (not registered itself). They train on
    ``data.path`` through ``data.tokenizer`` when given, else on pydoc's text as bytes."""

    # Model. VOCAB_SIZE None: the tokenizer's (data.tokenizer; bytes: 256), rounded up to a
    # multiple of 128.
    VOCAB_SIZE: Optional[int] = None
    NUM_LAYERS = 2
    MODEL_DIMS = 128
    HIDDEN_DIMS = 128
    NUM_HEADS = 4
    DIM_PER_HEAD: Optional[int] = None
    NUM_EXPERTS = 8
    TOP_K = 2
    MOE_HIDDEN_DIMS: Optional[int] = None
    MOE_LAYERS: Optional[Sequence[int]] = None
    AUX_LOSS_COEFF = 0.01
    REPEAT = False
    FPROP_DTYPE = "float32"
    REMAT = False
    FUSE_GATE_UP = False  # MoEFeedForward.fuse_gate_up (one wi_gate_up weight, fused GEMM)
    AUX_LOSS_TYPE = "switch"
    # DeepSeek-V3's first_k_dense_replace: layers [0, k) dense, a dense FFN of HIDDEN_DIMS.
    FIRST_K_DENSE = 0
    # Routing, shared experts and FP8 of the MoE layers (gating_func='topk'): the knobs of
    # MOE_KNOBS, each the MoEFeedForward field in capitals, starting from MoEConfig's default.
    SCORE_FUNC = config_default("score_func")
    NORM_TOPK = config_default("norm_topk")
    NUM_EXPERT_GROUPS = config_default("num_expert_groups")
    GROUP_TOPK = config_default("group_topk")
    USE_EXPERT_BIAS = config_default("use_expert_bias")
    EXPERT_BIAS_UPDATE_RATE = config_default("expert_bias_update_rate")
    ROUTED_SCALING_FACTOR = config_default("routed_scaling_factor")
    NUM_SHARED_EXPERTS = config_default("num_shared_experts")
    SHARED_HIDDEN_DIMS: Optional[int] = config_default("shared_hidden_dims")
    # FP8: None or 'blockwise' (FP8 expert GEMMs; MODEL_DIMS and the experts' hidden dims
    # multiples of 128). FP8_GEMMS: 'auto' (FP8 where it pays: moe_praxis.ops.fp8.rule), 'all', or
    # the GEMMs in FP8 joined by '+' ('fwd+dgrad': wgrad in bf16; quality runs, one GEMM at a time).
    FP8: Optional[str] = config_default("fp8")
    FP8_GEMMS = config_default("fp8_gemms")
    # REGATHER_ROWS: the experts' backward permutes x again instead of keeping the rows [T*k, M]
    # (less activation memory for one more permute; MoEConfig.regather_rows).
    REGATHER_ROWS = config_default("regather_rows")
    # ROUTER_Z_LOSS_WEIGHT: the router z-loss mean(logsumexp(logits)^2)'s weight (ST-MoE's 1e-3
    # keeps router logits small; 0: none).
    ROUTER_Z_LOSS_WEIGHT = config_default("router_z_loss_weight")
    # ROUTER_INIT_SCALE: the router weight's initial scale, a multiple of the fan-in init (1:
    # the same as the other weights; MoEFeedForward.router_init_scale).
    ROUTER_INIT_SCALE = 1.0
    # Attention (moe_praxis.praxis.attention.GroupedQueryAttention). NUM_KV_HEADS None: one
    # key/value head per query head (multi-head attention). ATTENTION_IMPL: 'auto', 'xla' or
    # 'cudnn'. QK_NORM: None, 'per_head' or 'full'. ROPE_MAX_WAVELENGTH: the rotary base.
    NUM_KV_HEADS: Optional[int] = None
    ATTENTION_IMPL = "auto"
    QK_NORM: Optional[str] = None
    QK_NORM_EPSILON = 1e-6
    ROPE_MAX_WAVELENGTH = 10_000
    # Data. DATA_SOURCE None: 'text' when DATA_PATH is set, else 'pydoc'.
    DATA_SOURCE: Optional[str] = None
    DATA_PATH: Optional[str] = None
    SEQ_LEN = 64
    BATCH_SIZE = 16
    HELDOUT_FRACTION = 0.1
    DATA_SEED = 0
    # Optimizer.
    LEARNING_RATE = 3e-3
    WARMUP_STEPS = 20
    SCHEDULE = "cosine"
    WEIGHT_DECAY = 0.01
    CLIP_NORM = 1.0
    # Loop.
    NUM_STEPS = 200
    EVAL_EVERY = 50
    EVAL_BATCHES = 4
    CHECKPOINT_EVERY = 100
    SUMMARY_EVERY = 10
    SEED = 0
    # Mesh (shape, names, and the MeshResources roles).
    MESH_SHAPE = (-1, )
    MESH_AXIS_NAMES = ("data", )
    DP = "data"
    FSDP = None
    EP = None
    TP = None
    FSDP_DIM = "expert"

    def model(self) -> pax_fiddle.Config:
        return models.transformer_lm(vocab_size=self.VOCAB_SIZE,
                                     model_dims=self.MODEL_DIMS,
                                     hidden_dims=self.HIDDEN_DIMS,
                                     num_layers=self.NUM_LAYERS,
                                     num_heads=self.NUM_HEADS,
                                     dim_per_head=self.DIM_PER_HEAD,
                                     num_experts=self.NUM_EXPERTS,
                                     top_k=self.TOP_K,
                                     moe_hidden_dims=self.MOE_HIDDEN_DIMS,
                                     moe_layers=self.MOE_LAYERS,
                                     aux_loss_coeff=self.AUX_LOSS_COEFF,
                                     repeat=self.REPEAT,
                                     fprop_dtype=self.FPROP_DTYPE,
                                     remat=self.REMAT,
                                     fuse_gate_up=self.FUSE_GATE_UP,
                                     first_k_dense=self.FIRST_K_DENSE,
                                     aux_loss_type=self.AUX_LOSS_TYPE,
                                     moe_fields=self.moe_fields(),
                                     num_kv_heads=self.NUM_KV_HEADS,
                                     attention_impl=self.ATTENTION_IMPL,
                                     qk_norm=self.QK_NORM,
                                     qk_norm_epsilon=self.QK_NORM_EPSILON,
                                     rope_max_wavelength=self.ROPE_MAX_WAVELENGTH)

    def moe_fields(self) -> dict:
        """The MoE layers' fields set by the MOE_KNOBS and LAYER_KNOBS knobs."""
        return {field: getattr(self, field.upper()) for field in MOE_KNOBS + LAYER_KNOBS}

    def data(self) -> fdl.Config:
        return fdl.Config(base.DataConfig,
                          source=self.DATA_SOURCE,
                          path=self.DATA_PATH,
                          seq_len=self.SEQ_LEN,
                          batch_size=self.BATCH_SIZE,
                          heldout_fraction=self.HELDOUT_FRACTION,
                          seed=self.DATA_SEED)

    def optimizer(self) -> fdl.Config:
        return fdl.Config(base.OptimizerConfig,
                          learning_rate=self.LEARNING_RATE,
                          warmup_steps=self.WARMUP_STEPS,
                          schedule=self.SCHEDULE,
                          weight_decay=self.WEIGHT_DECAY,
                          clip_norm=self.CLIP_NORM)

    def mesh(self) -> fdl.Config:
        return fdl.Config(base.MeshConfig,
                          shape=tuple(self.MESH_SHAPE),
                          axis_names=tuple(self.MESH_AXIS_NAMES),
                          dp=self.DP,
                          fsdp=self.FSDP,
                          ep=self.EP,
                          tp=self.TP,
                          fsdp_dim=self.FSDP_DIM)

    def train(self) -> fdl.Config:
        return fdl.Config(base.TrainConfig,
                          num_steps=self.NUM_STEPS,
                          eval_every=self.EVAL_EVERY,
                          eval_batches=self.EVAL_BATCHES,
                          checkpoint_every=self.CHECKPOINT_EVERY,
                          summary_every=self.SUMMARY_EVERY,
                          seed=self.SEED)

    def experiment_config(self) -> pax_fiddle.Config:
        """The whole experiment as one Fiddle config (nothing built yet), the model's
        sharding written from the mesh (``configs.sharding.annotate``)."""
        cfg = pax_fiddle.Config(base.ExperimentConfig,
                                name=short_name(type(self)),
                                model=self.model(),
                                data=self.data(),
                                optimizer=self.optimizer(),
                                mesh=self.mesh(),
                                train=self.train())
        sharding.annotate(cfg)
        return cfg


@register
class Tiny(LanguageModel):
    """2 MoE layers, M=128, 8 experts (H=128) top-2, 16 x 64 bytes of pydoc topics a step:
    trains on a CPU in about a minute."""


@register
class TinySynthetic(Tiny):
    """Tiny on the synthetic order-2 Markov source."""
    DATA_SOURCE = "synthetic"


@register
class TinyBf16(Tiny):
    """Tiny with bf16 activations and expert GEMMs: the baseline of TinyFp8."""
    FPROP_DTYPE = "bfloat16"


@register
class TinyFp8(TinyBf16):
    """TinyBf16 with the expert GEMMs in blockwise FP8 (MoEFeedForward.fp8='blockwise'); the
    same seed and data, so the two held-out losses compare the number formats. Every expert
    GEMM in FP8 (fp8_gemms='all'): at Tiny's few rows per expert 'auto' would run bf16."""
    FP8 = "blockwise"
    FP8_GEMMS = "all"


@register
class SmallGpu(LanguageModel):
    """One GPU: 8 layers, M=1024, 8 experts top-2 (H=2048), bf16 activations."""
    NUM_LAYERS = 8
    MODEL_DIMS = 1024
    HIDDEN_DIMS = 2048
    NUM_HEADS = 16
    NUM_EXPERTS = 8
    SEQ_LEN = 1024
    BATCH_SIZE = 32
    FPROP_DTYPE = "bfloat16"
    LEARNING_RATE = 1e-3
    WARMUP_STEPS = 200
    NUM_STEPS = 5000
    EVAL_EVERY = 500
    CHECKPOINT_EVERY = 1000
    MESH_SHAPE = (1, )


class _Cluster(LanguageModel):
    """What the multi-GPU presets share (not registered): a scanned, rematerialised stack in
    bfloat16, 4096-byte sequences, 100k steps, a data x fsdp x expert mesh."""
    REPEAT = True
    REMAT = True
    FPROP_DTYPE = "bfloat16"
    SEQ_LEN = 4096
    WARMUP_STEPS = 2000
    NUM_STEPS = 100000
    EVAL_EVERY = 1000
    CHECKPOINT_EVERY = 1000
    MESH_AXIS_NAMES = ("data", "fsdp", "expert")
    DP, FSDP, EP = "data", "fsdp", "expert"


@register(name="mixtral_8x7b")
class Mixtral8x7B(_Cluster):
    """Mixtral-8x7B layer shapes on 64 GPUs (dp2 x fsdp4 x ep8).
    Trains on pydoc as bytes unless given data.path and data.tokenizer (<Mixtral's SentencePiece tokenizer.model>)."""
    VOCAB_SIZE = 32000
    NUM_LAYERS = 32
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 14336
    NUM_HEADS = 32
    NUM_KV_HEADS = 8
    ROPE_MAX_WAVELENGTH = 1_000_000
    NUM_EXPERTS = 8
    TOP_K = 2
    BATCH_SIZE = 64
    LEARNING_RATE = 3e-4
    MESH_SHAPE = (2, 4, 8)
    FSDP_DIM = "model"  # 8 experts cannot be split over ep8 x fsdp4: fsdp shards d_model


@register(name="deepseek_v3")
class DeepSeekV3(_Cluster):
    """DeepSeek-V3 on 256 GPUs (fsdp8 x ep32): its MoE layer shapes and routing (sigmoid scores,
    8 expert groups of which 4 per token, the auxiliary-loss-free expert bias updated at
    0.001 a step, routed scaling 2.5, the k weights renormalised), 1 shared expert, the first 3
    layers dense. Plain multi-head attention stands in for its MLA.
    Trains on pydoc as bytes unless given data.path and data.tokenizer (<DeepSeek-V3's tokenizer.json>)."""
    VOCAB_SIZE = 129280
    NUM_LAYERS = 61
    MODEL_DIMS = 7168
    HIDDEN_DIMS = 18432  # the dense layers' FFN
    MOE_HIDDEN_DIMS = 2048
    NUM_HEADS = 128
    DIM_PER_HEAD = 128
    NUM_EXPERTS = 256
    TOP_K = 8
    FIRST_K_DENSE = 3
    SCORE_FUNC = "sigmoid"
    NORM_TOPK = True
    NUM_EXPERT_GROUPS = 8
    GROUP_TOPK = 4
    USE_EXPERT_BIAS = True
    EXPERT_BIAS_UPDATE_RATE = 1e-3
    ROUTED_SCALING_FACTOR = 2.5
    NUM_SHARED_EXPERTS = 1  # of width MOE_HIDDEN_DIMS
    # its complementary sequence-wise balance loss, alpha = 0.0001
    AUX_LOSS_TYPE = "sequence"
    AUX_LOSS_COEFF = 1e-4
    # fine-grained experts (H=2048): the fused gate/up GEMM pays where H is small, with the
    # backward (docs/grouped_gemm.md, "Fused gate/up")
    FUSE_GATE_UP = True
    # REPEAT: 3 dense layers, then 58 scanned MoE layers (DenseFirstRepeated)
    BATCH_SIZE = 256
    LEARNING_RATE = 2.2e-4
    MESH_SHAPE = (1, 8, 32)


@register
class Qwen3Moe(_Cluster):
    """Qwen3-30B-A3B's MoE shapes and routing (128 fine-grained experts of H=768, top-8,
    softmax with the 8 weights renormalised, no shared expert, every layer MoE) on 32 GPUs
    (fsdp4 x ep8), with its attention: 32 query heads, 4 key/value heads, per-head q/k RMSNorm,
    rotary base 1e6.
    Trains on pydoc as bytes unless given data.path and data.tokenizer (<Qwen3's tokenizer.json>)."""
    VOCAB_SIZE = 151936
    NUM_LAYERS = 48
    MODEL_DIMS = 2048
    HIDDEN_DIMS = 6144
    MOE_HIDDEN_DIMS = 768
    NUM_HEADS = 32
    NUM_KV_HEADS = 4
    QK_NORM = "per_head"
    ROPE_MAX_WAVELENGTH = 1_000_000
    DIM_PER_HEAD = 128
    NUM_EXPERTS = 128
    TOP_K = 8
    SCORE_FUNC = "softmax"
    NORM_TOPK = True
    AUX_LOSS_COEFF = 1e-3
    FUSE_GATE_UP = True
    BATCH_SIZE = 128
    LEARNING_RATE = 3e-4
    MESH_SHAPE = (1, 4, 8)


GPU_PRESETS = (SmallGpu, Mixtral8x7B, DeepSeekV3, Qwen3Moe)

# ------------------------------------------------------------ --fdl_config=NAME entry points

# tiny(), tiny_synthetic(), ..., qwen3_moe(): one function per experiment registered above
define_config_functions(globals())
