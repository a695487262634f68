"""GroupedQueryAttention: Praxis's DotProductAttention with grouped-query heads, optional
query/key RMSNorm, and an attention core that does not materialize the logits on CUDA.

Letters as in ``moe_praxis.attention``: B batch, T/S query/key length, D model dims, N query
heads, K key/value heads, H head dim.

Variables (``num_kv_heads=None`` keeps DotProductAttention's names and shapes, so checkpoints
of runs with Praxis's attention load unchanged):
  query/w [D, N, H], key/w [D, K, H], value/w [D, K, H], post/w [D, N, H]
  qk_norm='per_head': query_norm/scale [H], key_norm/scale [H] (Qwen3-MoE)
  qk_norm='full':     query_norm/scale [N*H], key_norm/scale [K*H] (OLMoE)
The norms are Praxis RmsNorms with direct_scale (y = x / rms(x) * scale), applied to the
projections before the rotary embedding.

Decode cache (``extend_step``): 'key_state' [B, S, K, H] holds the keys after the norm and the
rotary embedding, 'value_state' [B, S, K, H] the values: K heads, not N.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from praxis import base_layer, pax_fiddle, py_utils
from praxis.layers import attentions, normalizations

from moe_praxis import attention as attn

JTensor = base_layer.JTensor
QK_NORMS = (None, "per_head", "full")

# DotProductAttention features this layer does not implement, with the value that leaves
# them off.
_OFF = {
    "combine_qkv": False,
    "dconv_qkv": False,
    "relative_bias_tpl": None,
    "ngrammer_tpl": None,
    "ln_tpl": None,
    "internal_enable_per_dim_scale": False,
    "atten_logit_cap": 0.0,
    "attention_extra_logit": None,
    "scale_logits_by_head_dims": False,
    "zero_fully_masked": False,
    "consolidate_rope_key_state": False,
    "atten_dropout_prob": 0.0,
}


class GroupedQueryAttention(attentions.DotProductAttention):
    """Causal self-attention with K = num_kv_heads key/value heads shared by N / K query heads
    each (K = N: multi-head attention with DotProductAttention's variables).

    Attributes:
      num_kv_heads: K, a divisor of num_heads (None: num_heads, DotProductAttention's names).
      attention_impl: 'auto' (cuDNN flash attention where it can run, else XLA), 'xla', or
        'cudnn' (an error naming why where it cannot run); moe_praxis.attention.
      qk_norm: None, 'per_head' (RMSNorm over each head's H values) or 'full' (over the N*H
        query and K*H key values of a token).
      qk_norm_epsilon: the norms' epsilon.
      packed_input: the rows hold packed documents (data.packing='documents'): cuDNN runs its
        packed-segments route, the segments read from the mask.
      padded_rows: the rows may carry padding (the sampler's left-padded prompts): the XLA
        route applies the mask as given (cuDNN's causal routes do not read it).
    """
    num_kv_heads: Optional[int] = None
    attention_impl: str = "auto"
    qk_norm: Optional[str] = None
    qk_norm_epsilon: float = 1e-6
    packed_input: bool = False
    padded_rows: bool = False

    def _check_fields(self) -> int:
        """Validates the fields; returns the head dim H."""
        name = f"GroupedQueryAttention {self.name!r}"
        attn.check_impl(self.attention_impl)
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"{name}: qk_norm={self.qk_norm!r} is invalid; valid: {QK_NORMS}")
        k = self.num_kv_heads
        if k is not None and (not isinstance(k, int) or k < 1 or self.num_heads % k):
            raise ValueError(f"{name}: num_kv_heads={k!r} is invalid: a divisor of num_heads="
                             f"{self.num_heads} (or None for num_heads)")
        for field, off in _OFF.items():
            value = getattr(self, field)
            if value != off and not (off == 0.0 and not value):
                raise ValueError(f"{name}: {field}={value!r} is not supported; set {off!r}")
        if self.dim_per_head is not None:
            return self.dim_per_head
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"{name}: hidden_dim={self.hidden_dim} is not a multiple of "
                             f"num_heads={self.num_heads}")
        return self.hidden_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def setup(self) -> None:
        h = self._check_fields()
        wp = self.weight_split_dims_mapping

        def projection(heads, **kw):
            p = self.proj_tpl.clone().set(input_dim=self.input_dim,
                                          num_heads=heads,
                                          dim_per_head=h,
                                          use_bias=self.use_bias,
                                          **kw)
            p.weight_split_dims_mapping.wt = wp.proj
            return p

        self.create_child("query", projection(self.num_heads))
        self.create_child("key", projection(self.kv_heads))
        self.create_child("value", projection(self.kv_heads))
        self.create_child(
            "post",
            projection(self.num_heads,
                       is_output_projection=True,
                       use_nhd_shape=self.output_proj_use_nhd_shape))
        if self.use_rotary_position_emb:
            self._create_rotary_position_emb(self.rotary_position_emb_tpl, h)
        if self.qk_norm is not None:
            per_head = self.qk_norm == "per_head"
            for child, heads in (("query_norm", self.num_heads), ("key_norm", self.kv_heads)):
                self.create_child(
                    child,
                    pax_fiddle.Config(normalizations.RmsNorm,
                                      dim=h if per_head else heads * h,
                                      epsilon=self.qk_norm_epsilon,
                                      direct_scale=True))

    @nn.nowrap
    def _norm(self, child: str, x: JTensor) -> JTensor:
        """x [..., heads, H] through the query or key norm (qk_norm), or unchanged."""
        if self.qk_norm is None:
            return x
        if self.qk_norm == "per_head":
            return getattr(self, child)(x)
        flat = x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1], ))
        return getattr(self, child)(flat).reshape(x.shape)

    @nn.nowrap
    def _scale(self) -> float:
        """The logits' scale: DotProductAttention._scale_query's, 1/sqrt(H) by default."""
        if not self.internal_enable_query_scale:
            return 1.0
        if self.scale_query_by_dim_per_head and self.dim_per_head is not None:
            return self.dim_per_head**-0.5
        return (self.hidden_dim // self.num_heads)**-0.5

    def __call__(self,
                 query_vec: JTensor,
                 key_vec: JTensor,
                 value_vec: JTensor,
                 atten_mask: JTensor,
                 query_segment_pos: Optional[JTensor] = None,
                 key_segment_pos: Optional[JTensor] = None) -> tuple[JTensor, None]:
        """query_vec [B, T, D], key_vec, value_vec [B, S, D], atten_mask [B|1, 1, T|1, S]
        (Praxis's additive mask), segment positions [B, T] / [B, S] (rotary) -> ([B, T, D],
        None: no probabilities exist on the fused routes)."""
        # The projections carry Praxis's checkpoint names (remat policies may keep them).
        q = self._norm("query_norm", checkpoint_name(self.query(query_vec), "query_proj"))
        k = self._norm("key_norm", checkpoint_name(self.key(key_vec), "key_proj"))
        v = checkpoint_name(self.value(value_vec), "value_proj")  # [B, S, K, H]
        if self.use_rotary_position_emb:
            q = self.rotary_position_emb(q, query_segment_pos)
            k = self.rotary_position_emb(k, key_segment_pos)
        prefill = self.is_mutable_collection(base_layer.DECODE_CACHE) and self.decode_cache
        self._fprop_update_decode_state("key_state", k)
        self._fprop_update_decode_state("value_state", v)
        q, k, v = self._shard_blnh(q), self._shard_blnh(k), self._shard_blnh(v)
        plan = attn.choose(self.attention_impl,
                           q,
                           k,
                           v,
                           packed=self.packed_input,
                           need_mask=bool(self.padded_rows or prefill))
        encoded = attn.attend(q, k, v, atten_mask, plan, self._scale())
        encoded = checkpoint_name(self._shard_blnh(encoded), "context")
        encoded = self._shard_bld(self.post(encoded))
        return checkpoint_name(encoded, "out_proj"), None

    def _dot_atten_one_step(self,
                            query: JTensor,
                            key_state_name: str,
                            value_state_name: str,
                            atten_mask: JTensor,
                            relative_bias: Optional[JTensor] = None,
                            time_step: Optional[JTensor] = None) -> tuple[JTensor, JTensor]:
        """One query step against the cache: query [B, N, H], cached keys and values
        [B, S, K, H], atten_mask [B|1, 1, S] -> ([B, N, H], probabilities [B, N, S]).
        Softmax in float32, as DotProductAttention's."""
        del relative_bias, time_step
        key = self._shard_blnh(self.get_decode_state(key_state_name))
        value = self._shard_blnh(self.get_decode_state(value_state_name))
        b, s, kh, h = key.shape
        g = query.shape[1] // kh
        qg = query.reshape(b, kh, g, h) * jnp.asarray(self._scale(), query.dtype)
        logits = jnp.einsum("BKGH,BSKH->BKGS", qg, key, preferred_element_type=jnp.float32)
        mask = atten_mask[:, :, None, :]  # [B|1, 1, 1, S]
        logits = py_utils.apply_mask_to_logits(logits, mask)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(value.dtype)
        encoded = jnp.einsum("BKGS,BSKH->BKGH", probs, value).reshape(b, kh * g, h)
        return self._shard_bnh(encoded), probs.reshape(b, kh * g, s)

    def extend_step(self,
                    query_vec: JTensor,
                    *,
                    atten_mask: JTensor,
                    time_step: JTensor,
                    segment_pos: Optional[JTensor],
                    is_cross_attention: bool = False) -> JTensor:
        """One decode step: query_vec [B, D] at ``time_step``, atten_mask [B|1, 1, S] -> [B, D].
        Writes this step's key (normed, rotated) and value into the cache's K heads."""
        if is_cross_attention:
            raise ValueError(f"GroupedQueryAttention {self.name!r}: cross attention is not "
                             "supported")
        time_step = jnp.asarray(time_step)
        q = self._norm("query_norm", self.query.extend_step(query_vec, time_step=time_step))
        k = self._norm("key_norm", self.key.extend_step(query_vec, time_step=time_step))
        v = self.value.extend_step(query_vec, time_step=time_step)
        if self.use_rotary_position_emb:
            position = (jnp.broadcast_to(time_step, [query_vec.shape[0]])
                        if segment_pos is None else segment_pos)
            q = self.rotary_position_emb.extend_step(q, position)
            k = self.rotary_position_emb.extend_step(k, position)
        self.extend_decode_state("key_state", k, time_step, time_dim=1)
        self.extend_decode_state("value_state", v, time_step, time_dim=1)
        encoded, _ = self._dot_atten_one_step(self._shard_bnh(q), "key_state", "value_state",
                                              atten_mask)
        return self._shard_bd(self.post.extend_step(encoded, time_step=time_step))
