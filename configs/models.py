"""Model configs: a Praxis ``TransformerLm`` whose MoE layers are ``moe_praxis.MoEFeedForward``.

``transformer_lm(...)`` returns a ``pax_fiddle.Config`` (nothing is built), so every field can
still be changed by an experiment or a ``--fdl.model.X=`` override. Letters: M model_dims,
H hidden_dims, E num_experts, k top_k, V vocab_size.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import fiddle as fdl
from fiddle import daglish

import moe_praxis  # noqa: F401  (applies the Praxis-on-current-JAX shims first)
from praxis import base_layer, pax_fiddle
from praxis.layers import activations, embedding_softmax, normalizations, transformer_models
from praxis.layers import transformers

from moe_praxis.praxis import remat as remat_lib
from moe_praxis.praxis.attention import GroupedQueryAttention
from moe_praxis.praxis.stack import DenseFirstRepeated

# 'full': Praxis's remat as the presets configure it with REMAT=True (a repeated stack
# recomputes each layer whole); 'none': no remat; the others: moe_praxis.praxis.remat.POLICIES.
REMAT_POLICIES = ("full", "none") + tuple(remat_lib.POLICIES)


def moe_layer_class():
    """The MoE feed-forward layer class used by every preset."""
    return moe_praxis.MoEFeedForward


def moe_layer_tpl(*,
                  top_k: int,
                  moe_hidden_dims: int,
                  aux_loss_coeff: float,
                  gated: bool = True,
                  fuse_gate_up: bool = False,
                  aux_loss_type: str = "switch",
                  **layer_fields) -> pax_fiddle.Config:
    """The template StackedTransformer copies into each MoE layer (it sets num_experts,
    num_groups, min_group_size and gating_func itself): top-k routing ('topk', dropless softmax
    unless layer_fields say otherwise), SwiGLU experts, the Switch load-balancing loss.

    layer_fields: further MoEFeedForward fields (the routing options and shared experts:
    score_func, num_expert_groups, group_topk, use_expert_bias, expert_bias_update_rate,
    routed_scaling_factor, norm_topk, num_shared_experts, shared_hidden_dims, ...), validated
    by the layer's MoEConfig when it is set up."""
    tpl = pax_fiddle.Config(moe_layer_class(), name="moe")
    tpl.hidden_dims = moe_hidden_dims
    tpl.use_gated_activation = gated
    tpl.fuse_gate_up = fuse_gate_up
    tpl.activation_tpl = pax_fiddle.Config(activations.SiLU)
    tpl.moe_load_balance_loss_weight = aux_loss_coeff
    tpl.num_experts_per_token = top_k
    tpl.aux_loss_type = aux_loss_type
    for name, value in layer_fields.items():
        if not hasattr(tpl, name):
            raise ValueError(f"moe_layer_tpl: {name}={value!r}: MoEFeedForward has no field "
                             f"{name!r}")
        setattr(tpl, name, value)
    return tpl


def transformer_lm(
    *,
    vocab_size: int = 256,
    model_dims: int,
    hidden_dims: int,
    num_layers: int,
    num_heads: int,
    num_experts: int,
    top_k: int = 2,
    moe_hidden_dims: Optional[int] = None,
    moe_layers: Optional[Sequence[int]] = None,
    dim_per_head: Optional[int] = None,
    aux_loss_coeff: float = 0.01,
    repeat: bool = False,
    fprop_dtype: str = "float32",
    remat: bool | str = False,
    norm: str = "rms",
    fuse_gate_up: bool = False,
    first_k_dense: int = 0,
    aux_loss_type: str = "switch",
    moe_fields: Optional[dict] = None,
    tie_embeddings: bool = True,
    scale_embedding: bool = True,
    norm_epsilon: float = 1e-6,
    attention_bias: bool = True,
    softmax_bias: bool = True,
    num_kv_heads: Optional[int] = None,
    attention_impl: str = "auto",
    qk_norm: Optional[str] = None,
    qk_norm_epsilon: float = 1e-6,
    rope_max_wavelength: float = 10_000,
) -> pax_fiddle.Config:
    """A decoder-only LM: tied byte embedding/softmax, rotary attention, pre-norm blocks.

    moe_layers: indices of the MoE layers (None = every layer but the first ``first_k_dense``).
    first_k_dense: DeepSeek-V3's ``first_k_dense_replace``: layers [0, first_k_dense) are dense
      (a gated FFN of ``hidden_dims``), the rest MoE; written as Praxis's ``moe_layers``.
    With ``repeat=True`` the stack is a ``StackedTransformerRepeated`` of ``num_layers``
      identical one-layer MoE blocks (scanned: one trace for any depth), ``moe_layers`` must be
      None; with ``first_k_dense`` too it is ``moe_praxis.praxis.stack.DenseFirstRepeated``:
      that many dense layers, then ``num_layers - first_k_dense`` scanned MoE blocks.
    moe_fields: MoEFeedForward fields for the MoE layers (``moe_layer_tpl``'s layer_fields).
    tie_embeddings: one [M, V] matrix for the embedding and the output layer (False: Praxis's
      ``Embedding`` [V, M] and a ``FullSoftmax`` of their own, as most published checkpoints).
    scale_embedding: the embedding looked up scaled by sqrt(M) (the byte models' tied
      embedding, std 1/M; False for imported checkpoints, which never scale).
    norm_epsilon: every RMSNorm's epsilon. attention_bias / softmax_bias: biases on the
      attention projections / the output layer (Praxis's default; published MoE checkpoints
      have neither).
    The self-attention is ``moe_praxis.praxis.attention.GroupedQueryAttention``:
    num_kv_heads: key/value heads (None: num_heads, multi-head attention with Praxis
      DotProductAttention's variables); attention_impl: 'auto', 'xla' or 'cudnn';
      qk_norm: None, 'per_head' or 'full' RMSNorm of queries and keys (qk_norm_epsilon);
      rope_max_wavelength: the rotary embedding's base (its max_timescale).
    remat: Praxis's StackedTransformer.remat (True or False: ``remat_policy`` reads both as
      'full' in a repeated stack, whose scan saves nothing), or a name of REMAT_POLICIES
      (``set_remat``).
    Returns pax_fiddle.Config[TransformerLm]; inputs [B, S] int32 -> logits [B, S, V].
    """
    import jax.numpy as jnp

    if fprop_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"fprop_dtype={fprop_dtype!r} is invalid; valid: 'float32', "
                         "'bfloat16', 'float16'")
    if not isinstance(first_k_dense, int) or not 0 <= first_k_dense <= num_layers:
        raise ValueError(f"first_k_dense={first_k_dense!r} is invalid: an int in [0, "
                         f"num_layers={num_layers}]")
    if first_k_dense and moe_layers is not None:
        raise ValueError(f"first_k_dense={first_k_dense} and moe_layers={moe_layers!r} both "
                         "say which layers are MoE; set one of them")
    dtype = getattr(jnp, fprop_dtype)  # the scalar type, as Praxis writes it (serializable)
    lm = pax_fiddle.Config(transformer_models.TransformerLm,
                           name="lm",
                           model_dims=model_dims,
                           vocab_size=vocab_size,
                           fprop_dtype=dtype)
    lm.position_emb_tpl = None

    # Tied byte embedding and output layer W [M, V], std 1/M, looked up scaled by sqrt(M).
    # The logits of the final norm's unit-RMS output then have std 1/sqrt(M), and the input
    # token's own logit (the residual stream holds its embedding) is at most about M * std = 1,
    # so the initial loss is about ln(V). Praxis's LM configs' std 1/sqrt(M) (or the layer's
    # default Xavier) puts that own-token logit near sqrt(M), far above ln(V) for a wide model.
    # The token vectors start small (RMS 1/sqrt(M), as GPT-2's std-0.02 tied embedding); the
    # pre-norm blocks see them normalised.
    init = pax_fiddle.Config(base_layer.WeightInit, method="gaussian", scale=1.0 / model_dims)
    if tie_embeddings:
        lm.softmax_tpl = pax_fiddle.Config(embedding_softmax.SharedEmbeddingSoftmax,
                                           input_dims=model_dims,
                                           num_classes=vocab_size,
                                           scale_sqrt_depth=scale_embedding,
                                           params_init=init)
    else:
        lm.separate_embedding_tpl = pax_fiddle.Config(embedding_softmax.Embedding,
                                                      input_dims=model_dims,
                                                      num_classes=vocab_size,
                                                      scale_sqrt_depth=scale_embedding,
                                                      params_init=init)
        lm.softmax_tpl = pax_fiddle.Config(embedding_softmax.FullSoftmax,
                                           input_dims=model_dims,
                                           num_classes=vocab_size,
                                           params_init=init)
    lm.softmax_tpl.feed_forward_tpl.has_bias = softmax_bias
    rms = pax_fiddle.Config(normalizations.RmsNorm, epsilon=norm_epsilon)
    if norm == "rms":
        lm.final_ln_tpl = copy.deepcopy(rms)

    block = pax_fiddle.Config(transformers.StackedTransformer)
    block.model_dims = model_dims
    block.hidden_dims = hidden_dims
    block.num_heads = num_heads
    block.dim_per_head = dim_per_head
    block.num_experts = num_experts
    block.gating_func = "topk"
    layer = block.transformer_layer_params_tpl
    layer.norm_policy = "pre"
    if norm == "rms":
        layer.ln_tpl = copy.deepcopy(rms)
    layer.tr_atten_tpl = pax_fiddle.Config(
        GroupedQueryAttention,
        num_kv_heads=num_kv_heads,
        attention_impl=attention_impl,
        qk_norm=qk_norm,
        qk_norm_epsilon=qk_norm_epsilon,
        use_rotary_position_emb=True,
        internal_enable_per_dim_scale=False,
        # queries scaled by 1/sqrt(dim_per_head), not
        # Praxis's default 1/sqrt(model_dims / num_heads)
        scale_query_by_dim_per_head=dim_per_head is not None)
    layer.tr_atten_tpl.rotary_position_emb_tpl.max_timescale = rope_max_wavelength
    layer.tr_atten_tpl.use_bias = attention_bias
    layer.tr_fflayer_tpl.use_gated_activation = True
    layer.tr_fflayer_tpl.activation_tpl = pax_fiddle.Config(activations.SiLU)
    if norm == "rms":
        layer.tr_fflayer_tpl.ln_tpl = copy.deepcopy(rms)
    moe = moe_layer_tpl(top_k=top_k,
                        moe_hidden_dims=moe_hidden_dims or hidden_dims,
                        aux_loss_coeff=aux_loss_coeff,
                        fuse_gate_up=fuse_gate_up,
                        aux_loss_type=aux_loss_type,
                        **(moe_fields or {}))
    if norm == "rms":
        moe.ln_tpl = copy.deepcopy(rms)
    block.moe_layer_tpl = moe

    if repeat:
        if moe_layers is not None:
            raise ValueError(f"moe_layers={moe_layers!r} needs repeat=False: a repeated stack "
                             "makes every layer MoE (first_k_dense makes the first ones dense)")
        block.num_layers = 1
        block.moe_layers = [0]
        if first_k_dense:
            stack = pax_fiddle.Config(DenseFirstRepeated,
                                      block=block,
                                      x_times=num_layers - first_k_dense,
                                      first_k_dense=first_k_dense)
        else:
            stack = pax_fiddle.Config(transformers.StackedTransformerRepeated,
                                      block=block,
                                      x_times=num_layers)
    else:
        block.num_layers = num_layers
        block.moe_layers = (list(range(first_k_dense, num_layers))
                            if moe_layers is None else list(moe_layers))
        stack = block
    lm.stacked_transformer_tpl = stack
    if isinstance(remat, bool):
        block.remat = remat  # Praxis's remat, as every preset configured it
    else:
        set_remat(lm, remat)
    return lm


def set_remat(lm: pax_fiddle.Config, policy: str) -> None:
    """Puts a remat policy (REMAT_POLICIES) on a model config, through Praxis's own fields:
    'full' is Praxis's block remat (a repeated stack's scan saving nothing: each layer
    recomputed whole; an unrolled stack with Praxis's default block policy), 'none' no remat
    (a repeated stack's scan saving everything), a name of moe_praxis.praxis.remat.POLICIES
    the policy of the scan (repeated stack) or of the block's remat (unrolled stack)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat={policy!r} is invalid; valid: True, False, "
                         f"{', '.join(REMAT_POLICIES)}")
    block, st = stack_block(lm), lm.stacked_transformer_tpl
    ckpt = transformers.AutodiffCheckpointType
    repeated = hasattr(st, "x_times")
    block.remat = policy == "full" or (policy != "none" and not repeated)
    block.checkpoint_policy = policy if policy in remat_lib.POLICIES and not repeated else (
        ckpt.SAVE_DOT_EXCEPT_LOGITS_FFN1)  # Praxis's default
    if repeated:
        st.checkpoint_policy = {
            "full": ckpt.SAVE_NOTHING,
            "none": ckpt.SAVE_EVERYTHING
        }.get(policy, policy)


def remat_policy(lm: pax_fiddle.Config) -> str:
    """The remat policy of a model config (REMAT_POLICIES; another Praxis policy by its value)."""
    block, st = stack_block(lm), lm.stacked_transformer_tpl
    ckpt = transformers.AutodiffCheckpointType
    if hasattr(st, "x_times"):
        if block.remat or st.checkpoint_policy == ckpt.SAVE_NOTHING:
            return "full"
        return "none" if st.checkpoint_policy == ckpt.SAVE_EVERYTHING else str(
            getattr(st.checkpoint_policy, "value", st.checkpoint_policy))
    if not block.remat:
        return "none"
    if block.checkpoint_policy == ckpt.SAVE_DOT_EXCEPT_LOGITS_FFN1:
        return "full"
    return str(getattr(block.checkpoint_policy, "value", block.checkpoint_policy))


def stack_block(lm: pax_fiddle.Config) -> pax_fiddle.Config:
    """The StackedTransformer config inside an LM config (the repeated block, if repeated)."""
    st = lm.stacked_transformer_tpl
    return st.block if hasattr(st, "block") and hasattr(st, "x_times") else st


def first_repeated_layer(lm: pax_fiddle.Config) -> int:
    """The index of the first layer of the repeats (the dense layers before a
    DenseFirstRepeated's repeats; 0 for any other stack)."""
    return getattr(lm.stacked_transformer_tpl, "first_k_dense", 0)


def num_layers(lm: pax_fiddle.Config) -> int:
    st = lm.stacked_transformer_tpl
    if hasattr(st, "x_times"):
        return first_repeated_layer(lm) + st.x_times * st.block.num_layers
    return st.num_layers


def attention_configs(lm: pax_fiddle.Config) -> list:
    """Every GroupedQueryAttention config inside a model config (each template once; none in
    a config recorded before the model used it: Praxis's DotProductAttention)."""
    return _configs_of(lm, GroupedQueryAttention)


def set_attention(lm: pax_fiddle.Config, **fields) -> None:
    """Sets GroupedQueryAttention fields (attention_impl, packed_input, padded_rows, ...) on
    every attention layer of a model config; a config without one is left as it is."""
    for cfg in attention_configs(lm):
        for name, value in fields.items():
            if not hasattr(cfg, name):
                raise ValueError(f"set_attention: {name}={value!r}: GroupedQueryAttention has "
                                 f"no field {name!r}")
            setattr(cfg, name, value)


def _configs_of(lm: pax_fiddle.Config, cls) -> list:
    found = []

    def visit(value, state):
        if isinstance(value, fdl.Buildable) and fdl.get_callable(value) is cls:
            found.append(value)
        return state.map_children(value)

    daglish.MemoizedTraversal.run(visit, lm)
    return found


def moe_layer_configs(lm: pax_fiddle.Config) -> list:
    """Every MoEFeedForward config inside a model config (each template once)."""
    return _configs_of(lm, moe_layer_class())
