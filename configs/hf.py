"""The experiment of a model imported from a Hugging Face checkpoint (``experiments.import_hf``).

``HfModel`` holds the numbers of a Mixtral, Qwen3-MoE or OLMoE ``config.json`` that the Praxis
model needs (``experiments.hf.checkpoint.read_config`` makes one); ``imported_experiment`` turns
it into an experiment config like any preset's: a ``TransformerLm`` whose every layer is
grouped-query attention (rotary, base ``rope_theta``; q/k RMSNorm per head for Qwen3-MoE, over
all heads for OLMoE) and a ``moe_praxis.MoEFeedForward`` (softmax top-k, renormalised where
``norm_topk``, dropless, router in float32), RMSNorms of the checkpoint's epsilon, an untied
embedding and output layer unless the checkpoint ties them, neither scaled by sqrt(M) and
neither with a bias. The import records the result in the job directory (``config.json``), from
which every later start rebuilds it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from praxis import pax_fiddle

from configs import models
from configs.experiments import LanguageModel, use_mesh

ARCHS = ("mixtral", "qwen3_moe", "olmoe")


@dataclasses.dataclass(frozen=True)
class HfModel:
    """A Hugging Face MoE decoder's shapes and routing. Letters: M model_dims, N num_heads,
    K num_kv_heads, D head_dim, E num_experts, k top_k, H moe_hidden_dims, V vocab_size."""
    arch: str  # one of ARCHS
    vocab_size: int  # V
    model_dims: int  # M (hidden_size)
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # D
    num_experts: int  # E
    top_k: int  # k
    moe_hidden_dims: int  # H (each expert's)
    norm_topk: bool  # renormalise the k softmax weights to sum to 1
    rope_theta: float
    norm_epsilon: float  # every RMSNorm's
    qk_norm: Optional[str]  # None, 'per_head' (Qwen3-MoE) or 'full' (OLMoE)
    tie_embeddings: bool
    aux_loss_coeff: float  # router_aux_loss_coef
    z_loss_coeff: float = 0.0  # OLMoE's router_z_loss_coef

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"HfModel.arch={self.arch!r} is invalid; valid: {ARCHS}")

    @property
    def num_params(self) -> int:
        """Parameters of the model (the output layer counted once when tied)."""
        m, d = self.model_dims, self.head_dim
        attn = m * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        qk = {None: 0, "per_head": 2 * d, "full": d * (self.num_heads + self.num_kv_heads)}
        moe = self.num_experts * 3 * m * self.moe_hidden_dims + m * self.num_experts
        layer = attn + qk[self.qk_norm] + moe + 2 * m
        emb = self.vocab_size * m * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + m


class HfImported(LanguageModel):
    """An imported checkpoint's experiment (not registered: its knobs come from an ``HfModel``,
    ``imported_experiment`` sets them). Defaults for fine-tuning: AdamW at 1e-5 after 10
    warmup steps, a constant schedule, no weight decay."""
    SPEC: Optional[HfModel] = None
    FPROP_DTYPE = "float32"
    LEARNING_RATE = 1e-5
    WARMUP_STEPS = 10
    SCHEDULE = "constant"
    WEIGHT_DECAY = 0.0
    NUM_STEPS = 100
    EVAL_EVERY = 50
    CHECKPOINT_EVERY = 100

    def model(self) -> pax_fiddle.Config:
        s = self.SPEC
        lm = models.transformer_lm(vocab_size=s.vocab_size,
                                   model_dims=s.model_dims,
                                   hidden_dims=s.moe_hidden_dims,
                                   num_layers=s.num_layers,
                                   num_heads=s.num_heads,
                                   dim_per_head=s.head_dim,
                                   num_experts=s.num_experts,
                                   top_k=s.top_k,
                                   moe_hidden_dims=s.moe_hidden_dims,
                                   aux_loss_coeff=s.aux_loss_coeff,
                                   repeat=self.REPEAT,
                                   fprop_dtype=self.FPROP_DTYPE,
                                   remat=self.REMAT,
                                   moe_fields=self.moe_fields(),
                                   num_kv_heads=s.num_kv_heads,
                                   qk_norm=s.qk_norm,
                                   qk_norm_epsilon=s.norm_epsilon,
                                   rope_max_wavelength=s.rope_theta,
                                   tie_embeddings=s.tie_embeddings,
                                   scale_embedding=False,
                                   norm_epsilon=s.norm_epsilon,
                                   attention_bias=False,
                                   softmax_bias=False)
        # logits scaled by 1/sqrt(head_dim), as transformers does, also where head_dim is not
        # model_dims / num_heads (Qwen3-MoE: 128 vs 2048 / 32)
        models.set_attention(lm, scale_query_by_dim_per_head=True)
        return lm

    def moe_fields(self) -> dict:
        return dict(score_func="softmax",
                    norm_topk=self.SPEC.norm_topk,
                    router_precision="float32",
                    router_z_loss_weight=self.SPEC.z_loss_coeff)


def imported_experiment(spec: HfModel,
                        *,
                        name: str,
                        tokenizer: str,
                        data_path: str,
                        seq_len: int = 512,
                        batch_size: int = 8,
                        fprop_dtype: str = "float32",
                        repeat: bool = False,
                        remat: bool = False,
                        mesh: Optional[dict] = None) -> pax_fiddle.Config:
    """The experiment config of an imported model: ``spec``'s model trained and evaluated on
    the documents of ``data_path`` through ``tokenizer`` (the checkpoint's tokenizer.json).

    repeat / remat: a scanned stack of the layers / rematerialised in the backward (as the
    cluster presets); mesh: ``MeshConfig`` fields (``configs.experiments.use_mesh``), e.g.
    ``dict(shape=(1, 8), axis_names=('data', 'expert'), ep='expert')``; default: data parallel
    over every device."""
    exp = HfImported()
    exp.SPEC = spec
    exp.FPROP_DTYPE = fprop_dtype
    exp.REPEAT = repeat
    exp.REMAT = remat
    exp.SEQ_LEN = seq_len
    exp.BATCH_SIZE = batch_size
    exp.DATA_PATH = data_path
    cfg = exp.experiment_config()
    cfg.name = name
    cfg.data.tokenizer = tokenizer
    if mesh:
        use_mesh(cfg, **mesh)
    return cfg
