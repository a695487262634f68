"""MoEFeedForward: a thin Praxis BaseLayer over ``moe_block``.

``MoEFeedForward`` is a drop-in replacement for Praxis's ``TransformerFeedForwardMoe``: set it
as ``StackedTransformer.moe_layer_tpl`` (or ``Transformer.tr_fflayer_tpl``) and nothing else
in the model config has to change. It accepts every field Praxis's ``Transformer``,
``StackedTransformer`` and PaxML's ``maybe_setup_moe_params`` write on that template, maps
them onto ONE ``MoEConfig`` built at setup (which validates the fields it holds; the layer
validates only its own), and raises a clear error at setup for any value it cannot honour.
docs/praxis.md lists the fields, the checkpoint names, the sharding letters and the summaries.
The field checks and the MoEConfig mapping live in ``moe_praxis.praxis.fields``, the GShard
capacity rule and checkpoint converter in ``moe_praxis.praxis.gshard``, the weight-sharding
check in ``moe_praxis.praxis.sharding``, the summaries in ``moe_praxis.praxis.summaries``.

Letters (GShard's, kept so ``TransformerLm.set_sharding_params_v1`` configures this layer):
  B batch, L length, M model dim, H hidden dim, E experts, T = B*L tokens;
  g / s: GShard's token groups and group size (our [B, L] token layout takes their place);
  e / c: GShard's expert / capacity dims of its one-hot dispatch tensors (not built here).

Forward (norm_policy='pre'):
  y = x + residual_weight * dropout(moe_block(layer_norm(x), paddings))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from praxis import base_layer
from praxis import pax_fiddle
from praxis.layers import activations as activations_lib
from praxis.layers import normalizations
from praxis.layers import stochastics

from moe_praxis import resources
from moe_praxis.balancing import update_expert_bias
from moe_praxis.experts import FP8_WEIGHTS
from moe_praxis.moe import MoEOutput, moe_block, param_shapes
from moe_praxis.praxis import compat
from moe_praxis.praxis import fields
from moe_praxis.praxis.gshard import capacity_and_groups, grouped_moe_block
from moe_praxis.praxis.sharding import checked_weight_splits
from moe_praxis.praxis.summaries import moe_summaries

JTensor = base_layer.JTensor
LayerTpl = pax_fiddle.Config[base_layer.BaseLayer]
SplitDimsMapping = base_layer.SplitDimsMapping
WeightHParams = base_layer.WeightHParams
WeightInit = base_layer.WeightInit
template_field = base_layer.template_field


class MoEFeedForward(base_layer.BaseLayer):
    """Pre/post layer norm, MoE feed-forward (moe_block), dropout and residual connection.

    Every field of Praxis's TransformerFeedForwardMoe, with its default and meaning
    (docs/praxis.md has the table, kept in step with these fields by a test), plus ours:
      fuse_gate_up: gated only; one weight wi_gate_up [E, M, 2H] (MoEConfig.fuse_gate_up).
      num_experts_per_token: k for gating_func='topk' (top2 / dense_top2 need 2).
      aux_loss_type, kernel_backend, router_precision, ep_exchange, ep_buffer_factor, fp8,
      fp8_quantize_before_gather, fp8_gemms, regather_rows, router_z_loss_weight (z_loss_coeff):
      MoEConfig's.
      router_init_scale: the router weight's initial scale, a multiple of the fan-in init the
        other weights get (1: the same; the layer's own, not MoEConfig's).
      mesh_resources: a moe_praxis.MeshResources; when set and a mesh is in scope
        (jax.set_mesh or `with mesh:`), moe_block runs expert-parallel on it, and when the
        layer also has mesh_axis_names and ici_mesh_shape its weight sharding is checked
        against the layout (moe_praxis.praxis.sharding).
    gating_func: 'top2' (GShard top-2 with its per-group capacity, moe_praxis.praxis.gshard),
    'dense_top2' (GShard top-2, dropless) or 'topk' (top-k routed by the fields below).

    Routing fields, each the MoEConfig field of its name, honoured by gating_func='topk' only
    ('top2' / 'dense_top2' route with the defaults; another value is an error at setup):
      score_func, pre_softmax: the router's score function (docs/config.md#router-math).
      norm_topk: renormalise the k weights to sum to 1.
      num_expert_groups, group_topk: DeepSeek-V3's group-limited routing (not num_groups).
      use_expert_bias: the selection-only expert bias (DeepSeek-V3's auxiliary-loss-free
        balancing), a NON_TRAINABLE float32 variable `expert_bias` [E].
      expert_bias_update_rate: u > 0 updates expert_bias in every training call (see
        _update_expert_bias).
      routed_scaling_factor: multiplies the routing weights.
      capacity_factor: None = dropless; else MoEConfig's capacity per expert, dropping by
        drop_policy ('position' or 'weight').
    Shared experts, with any gating_func: num_shared_experts, shared_hidden_dims (Hs; None =
    num_shared_experts * hidden_dims) and shared_expert_gate (Qwen2-MoE's sigmoid output gate),
    MoEConfig's num_shared_experts, shared_d_ff and shared_expert_gate.
    """

    input_dims: int = 0
    hidden_dims: int = 0
    apply_padding_first: bool = False
    ln_tpl: LayerTpl = template_field(normalizations.LayerNorm)
    activation_tpl: pax_fiddle.Config[activations_lib.BaseActivation] = template_field(
        activations_lib.ReLU)
    relu_dropout_tpl: LayerTpl = template_field(stochastics.Dropout)
    relu_dropout_prob: float = 0.0
    residual_dropout_tpl: LayerTpl = template_field(stochastics.Dropout)
    residual_dropout_prob: float = 0.0
    add_skip_connection: bool = True
    residual_weight: float = 1.0
    norm_policy: str = "pre"
    residual_droppath_prob: float = 0.0
    gating_func: str = "top2"
    num_experts: int = 0
    num_groups: int = 1
    min_group_size: Optional[int] = None
    expert_capacity_dim: int = 0
    unadjusted_expert_capacity_factor: float = 2.0
    expert_weight_shards: int = 1
    second_expert_policy: str = "all"
    internal_gshard_variance_scaling_fan_in_init: bool = True
    explicit_fan_in_fan_out_axes: bool = False
    moe_load_balance_loss_weight: float = 1.0
    gating_logit_cap: float = 0.0
    moe_gating_embedding_level: str = "token"
    use_gated_activation: bool = False
    fuse_gate_up: bool = False  # moe_praxis's fields from here on
    num_experts_per_token: int = 2
    aux_loss_type: str = "gshard"
    router_z_loss_weight: float = 0.0
    router_init_scale: float = 1.0
    kernel_backend: str = "auto"
    router_precision: str = "auto"
    mesh_resources: Any = None
    ep_exchange: str = "auto"
    ep_buffer_factor: Optional[float] = None
    # Routing (gating_func='topk' only; 'top2' / 'dense_top2' are GShard's softmax top-2).
    score_func: str = "softmax"
    pre_softmax: bool = True
    norm_topk: bool = True
    num_expert_groups: int = 1
    group_topk: int = 1
    use_expert_bias: bool = False
    expert_bias_update_rate: float = 0.0
    routed_scaling_factor: float = 1.0
    capacity_factor: Optional[float] = None
    drop_policy: str = "position"
    # Shared experts (any gating_func): a dense FFN added to the routed output.
    num_shared_experts: int = 0
    shared_hidden_dims: Optional[int] = None
    shared_expert_gate: bool = False
    fp8: Optional[str] = None  # FP8 expert GEMMs (MoEConfig.fp8, any gating_func)
    fp8_quantize_before_gather: bool = True
    fp8_gemms: str = "auto"  # which expert GEMMs run in FP8 (MoEConfig.fp8_gemms)
    regather_rows: bool = False  # the backward permutes x again (MoEConfig.regather_rows)

    class WeightSharding(base_layer.BaseLayer.WeightSharding):
        """Weight sharding (mesh axis per dim).

        Attributes:
          me: router [M, E].
          emh: wi_up and wi_gate [E, M, H].
          ehm: wo [E, H, M].
          mh: the shared experts' shared_wi_up and shared_wi_gate [M, Hs].
          hm: the shared experts' shared_wo [Hs, M].
        (shared_gate [M, 1] and expert_bias [E] are replicated.)
        """

        me: SplitDimsMapping = None
        emh: SplitDimsMapping = None
        ehm: SplitDimsMapping = None
        mh: SplitDimsMapping = None
        hm: SplitDimsMapping = None

    class ActivationSharding(base_layer.BaseLayer.ActivationSharding):
        """Activation sharding (mesh axis per dim).

        Attributes:
          gsm: the layer's token activations [B, L, M] (g -> B, s -> L): the normalised
            input to moe_block and its output ([B, M] in extend_step: g and m entries).
          gs: paddings [B, L].
          gsec, gecs, gec, egcm, egch, gecm: GShard's one-hot dispatch / combine and
            capacity-padded expert tensors. This layer sorts tokens instead and builds none
            of them; the fields exist so Praxis's sharding helpers can write them, their
            ranks are validated, and they have no effect (docs/praxis.md).
        """

        gsm: SplitDimsMapping = None
        gs: SplitDimsMapping = None
        gsec: SplitDimsMapping = None
        gecs: SplitDimsMapping = None
        gec: SplitDimsMapping = None
        egcm: SplitDimsMapping = None
        egch: SplitDimsMapping = None
        gecm: SplitDimsMapping = None

    # ------------------------------------------------------------------------- setup

    def setup(self) -> None:
        fields.validate(self)
        self.moe_config = fields.build_config(self)
        config = self.moe_config
        wp = self.weight_split_dims_mapping
        # Checked against the layout of mesh_resources when the layer knows its mesh; an unset
        # letter then takes the layout's spec.
        splits = checked_weight_splits(
            f"MoEFeedForward {self.name!r}",
            self.mesh_resources,
            self.mesh_axis_names,
            self.mesh_shape if self.ici_mesh_shape is not None else None,
            {letter: getattr(wp, letter, None)
             for letter in fields.WEIGHT_RANKS},
            num_experts=config.num_experts,
            d_model=config.d_model,
            d_ff=config.d_ff,
            shared_d_ff=config.shared_hidden or None)

        if self.norm_policy == "primer_hybrid":
            ln_p = self.ln_tpl.clone()
            ln_p.dim = self.input_dims
            self.create_child("pre_layer_norm", ln_p)
            self.create_child("post_layer_norm", ln_p)
        else:
            ln_p = self.ln_tpl.clone()
            ln_p.name = "layer_norm"
            ln_p.dim = self.input_dims
            self.create_child("layer_norm", ln_p)

        dropout_p = self.residual_dropout_tpl.clone()
        dropout_p.keep_prob = 1.0 - self.residual_dropout_prob
        self.create_child("residual_dropout", dropout_p)
        if self.residual_droppath_prob > 0:
            droppath_p = pax_fiddle.Config(stochastics.StochasticResidual,
                                           name="residual_droppath",
                                           survival_prob=1.0 - self.residual_droppath_prob)
            self.create_child("residual_droppath", droppath_p)

        def init(fan_in, scale=1.0):
            if self.internal_gshard_variance_scaling_fan_in_init:
                return WeightInit.Uniform(scale * math.sqrt(3.0 / fan_in))
            return WeightInit.Gaussian(scale / math.sqrt(fan_in))

        # The variables are moe_block's parameters (moe.param_shapes).
        shapes = param_shapes(config)
        for name, letter in fields.VARIABLE_LETTERS.items():
            if name in shapes:  # fan-in: the contracted dimension, shape[-2]
                self.create_variable(
                    name,
                    WeightHParams(shape=list(shapes[name]),
                                  init=init(shapes[name][-2],
                                            self.router_init_scale if name == "router" else 1.0),
                                  mesh_shape=self.mesh_shape,
                                  tensor_split_dims_mapping=splits[letter] if letter else [None] *
                                  len(shapes[name])))
        if "expert_bias" in shapes:
            # Updated outside the gradient (_update_expert_bias): NON_TRAINABLE, never optimized.
            self.create_variable("expert_bias",
                                 WeightHParams(shape=list(shapes["expert_bias"]),
                                               init=WeightInit.Constant(0.0),
                                               dtype=jnp.float32,
                                               mesh_shape=self.mesh_shape,
                                               tensor_split_dims_mapping=[None]),
                                 trainable=False)

    # ------------------------------------------------------------------------- forward

    def _shard(self, x, split):
        """x constrained to `split` (Praxis's maybe_shard). On the Explicit axes of the mesh in
        scope a sharding constraint only asserts the type, so x is resharded there instead."""
        if split is None or self.mesh_axis_names is None:
            return x
        types = resources.axis_types(jax.sharding.get_abstract_mesh())
        explicit = [a for a, t in types.items() if t == "Explicit"]
        if not explicit:
            return base_layer.maybe_shard(x, split, self.mesh_axis_names)
        spec = base_layer.to_partition_spec(split, self.mesh_axis_names)
        x = jax.sharding.reshard(x, resources.restrict_spec(spec, explicit))
        auto = resources.restrict_spec(spec, [a for a, t in types.items() if t == "Auto"])
        if any(e is not None for e in auto):
            x = jax.lax.with_sharding_constraint(x, auto)
        return x

    def _token_split(self, ndim: int):
        gsm = self.activation_split_dims_mapping.gsm
        if gsm is None or ndim == 3:
            return gsm
        return [gsm[0], gsm[2]]  # [B, M] in extend_step

    def _moe(self, x, paddings) -> MoEOutput:
        """x: [..., M] normalised input; paddings: x.shape[:-1] or None.

        With several GShard groups the losses and the router entropy are the groups' means,
        the counts their sums."""
        config = self.moe_config
        params = {
            name: self.get_var(name) if name == "expert_bias" else self.theta[name]
            for name in param_shapes(config)
        }
        # The FP8 form of the expert weights, when the train step made it once for all its
        # micro-batches (moe_praxis.praxis.fp8_params): an undeclared entry of the params.
        if config.fp8 is not None and self.has_variable(base_layer.PARAMS, FP8_WEIGHTS):
            params[FP8_WEIGHTS] = self.get_variable(base_layer.PARAMS, FP8_WEIGHTS)
        num_tokens = int(np.prod(x.shape[:-1]))
        mesh = compat.current_mesh() if self.mesh_resources is not None else None
        groups = 1
        if self.gating_func == "top2":
            # Expert parallel: the global batch is one group (moe_block's EP path applies one
            # capacity to the global batch, exactly as on one device).
            cf, groups = capacity_and_groups(num_tokens,
                                             num_experts=config.num_experts,
                                             top_k=config.top_k,
                                             num_groups=1 if mesh is not None else self.num_groups,
                                             min_group_size=self.min_group_size,
                                             expert_capacity_dim=self.expert_capacity_dim,
                                             capacity_factor=self.unadjusted_expert_capacity_factor,
                                             where=f"MoEFeedForward {self.name!r}")
            config = dataclasses.replace(config, capacity_factor=cf)
        if mesh is not None:
            return moe_block(params,
                             x,
                             config,
                             mesh=mesh,
                             resources=self.mesh_resources,
                             paddings=paddings)
        if groups == 1:
            return moe_block(params, x, config, paddings=paddings)
        if self.aux_loss_type == "sequence":
            raise ValueError(f"MoEFeedForward {self.name!r}: aux_loss_type='sequence' needs "
                             f"whole sequences; GShard token groups ({groups}) split them")
        return grouped_moe_block(params, x, config, groups, paddings)

    def _update_expert_bias(self, out: MoEOutput) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, in training calls only:
        expert_bias <- moe_praxis.update_expert_bias(expert_bias, tokens_per_expert, u), float32,
        on the call's global counts (reduced over every token axis), outside the gradient.
        Praxis's update_var writes only where NON_TRAINABLE is mutable (the trainer keeps the
        updated collection), and eval skips it: eval, decoding and init leave the bias."""
        rate = self.moe_config.expert_bias_update_rate
        if rate > 0 and not self.do_eval:
            counts = jax.lax.stop_gradient(out.tokens_per_expert)
            self.update_var("expert_bias",
                            update_expert_bias(self.get_var("expert_bias"), counts, rate))

    def __call__(self,
                 inputs: JTensor,
                 paddings: Optional[JTensor] = None,
                 segment_ids: Optional[JTensor] = None) -> JTensor:
        """Layer norm, route, experts, combine, dropout, residual.

        Args:
          inputs: [B, L, M] (or [B, M] in extend_step).
          paddings: [B, L] (or [B]), 1 = padded; padded tokens route to no expert, output
            zeros from the MoE branch and count in no statistic. None = no padding.
          segment_ids: accepted for the Praxis signature; unused (token-level routing).

        Returns:
          [B, L, M], inputs' shape and dtype.
        """
        del segment_ids  # only GShard's 'sentence' gating embedding used them
        if inputs.shape[-1] != self.input_dims:
            raise ValueError(f"MoEFeedForward {self.name!r}: inputs must be [..., "
                             f"input_dims={self.input_dims}], got {inputs.shape}")
        if paddings is not None:
            if paddings.shape != inputs.shape[:-1]:
                raise ValueError(f"MoEFeedForward {self.name!r}: paddings must have shape "
                                 f"{inputs.shape[:-1]}, got {paddings.shape}")
            if inputs.ndim == 3:
                paddings = self._shard(paddings, self.activation_split_dims_mapping.gs)
            if self.apply_padding_first:
                inputs = inputs * (1.0 - paddings[..., None]).astype(inputs.dtype)
        split = self._token_split(inputs.ndim)
        residual = inputs
        if self.norm_policy == "primer_hybrid":
            x = self.pre_layer_norm(inputs)
        elif self.norm_policy == "pre":
            x = self.layer_norm(inputs)
        else:
            x = inputs
        x = self._shard(x, split)
        out = self._moe(x, paddings)
        y = checkpoint_name(self._shard(out.y, split), "moe_out")  # a remat policy may keep it
        for name, value in moe_summaries(out, paddings, int(np.prod(x.shape[:-1])),
                                         self.moe_config).items():
            self.add_summary(name, value)
        if self.norm_policy == "primer_hybrid":
            y = self.post_layer_norm(y)
        elif self.norm_policy == "post":
            y = self.layer_norm(y)
        y = self.residual_dropout(y)
        if self.add_skip_connection:
            if self.residual_droppath_prob:
                y = self.residual_droppath(residual, y)
            else:
                y = residual + y * self.residual_weight
        if self.norm_policy == "post_skip":
            y = self.layer_norm(y)
        self._update_expert_bias(out)
        self.add_aux_loss("aux_moe_load_balance_loss", out.aux_loss.astype(jnp.float32))
        if self.router_z_loss_weight > 0:
            self.add_aux_loss("aux_moe_z_loss", out.z_loss.astype(jnp.float32))
        return y

    def extend_step(self, inputs: JTensor, *, time_step: JTensor) -> JTensor:
        """Decoding step: inputs [B, M] -> [B, M]."""
        del time_step
        return self.__call__(inputs)
