"""MoEFeedForward: a Praxis BaseLayer over ``moe_block``, and the GShard checkpoint converter.

``MoEFeedForward`` is a drop-in replacement for Praxis's ``TransformerFeedForwardMoe``: set it
as ``StackedTransformer.moe_layer_tpl`` (or ``Transformer.tr_fflayer_tpl``) and nothing else
in the model config has to change. It accepts every field Praxis's ``Transformer``,
``StackedTransformer`` and PaxML's ``maybe_setup_moe_params`` write on that template, maps
them onto ``MoEConfig``, and raises a clear error at setup for any value it cannot honour.
docs/praxis.md lists the fields, the checkpoint names and the sharding letters.

Letters (GShard's, kept so ``TransformerLm.set_sharding_params_v1`` configures this layer):
  B batch, L length, M model dim, H hidden dim, E experts, T = B*L tokens;
  g / s: GShard's token groups and group size (our [B, L] token layout takes their place);
  e / c: GShard's expert / capacity dims of its one-hot dispatch tensors (not built here).

Forward (norm_policy='pre'):
  y = x + residual_weight * dropout(moe_block(layer_norm(x), paddings))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from praxis import base_layer
from praxis import pax_fiddle
from praxis.layers import activations as activations_lib
from praxis.layers import normalizations
from praxis.layers import stochastics

from moe_praxis import compat
from moe_praxis import routing
from moe_praxis.config import AUX_LOSS_TYPES, KERNEL_BACKENDS, MoEConfig
from moe_praxis.moe import moe_block, param_shapes
from moe_praxis.resources import MeshResources

JTensor = base_layer.JTensor
LayerTpl = pax_fiddle.Config[base_layer.BaseLayer]
SplitDimsMapping = base_layer.SplitDimsMapping
WeightHParams = base_layer.WeightHParams
WeightInit = base_layer.WeightInit
template_field = base_layer.template_field

GATING_FUNCS = ("top2", "dense_top2", "topk")
NORM_POLICIES = ("pre", "post", "primer_hybrid", "post_skip")
# Praxis activation layer class -> MoEConfig.activation.
ACTIVATIONS = {
    activations_lib.ReLU: "relu",
    activations_lib.GELU: "gelu",  # approximate=True only (jax.nn.gelu's default)
    activations_lib.SiLU: "silu",
    activations_lib.Swish: "silu",  # jax.nn.swish is jax.nn.silu
}
# The parameter names of Praxis's TransformerFeedForwardMoe -> ours (moe_block's).
GSHARD_PARAM_NAMES = {"gate": "router", "wi_0": "wi_up", "wi_gate_0": "wi_gate", "wo_0": "wo"}


def _setup_error(layer: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"MoEFeedForward {layer!r}: {field}={value!r} is not supported: {why}.")


class MoEFeedForward(base_layer.BaseLayer):
    """Pre/post layer norm, MoE feed-forward (moe_block), dropout and residual connection.

    Praxis fields (the meaning of TransformerFeedForwardMoe's, see docs/praxis.md):
      input_dims, hidden_dims: M and H (each expert's hidden width).
      apply_padding_first: zero padded inputs before everything else.
      ln_tpl, norm_policy ('pre', 'post', 'primer_hybrid', 'post_skip'): layer norm placement.
      activation_tpl: ReLU, GELU (approximate), SiLU or Swish.
      use_gated_activation: expert = act(x @ wi_gate) * (x @ wi_up) @ wo.
      fuse_gate_up: (ours; gated only) one weight wi_gate_up [E, M, 2H] and one grouped GEMM
        for both projections (MoEConfig.fuse_gate_up); convert_gshard_params(...,
        fuse_gate_up=True) interleaves GShard's wi_gate_0 and wi_0 into it.
      relu_dropout_prob: must be 0 (dropout inside the experts is not implemented).
      residual_dropout_tpl / residual_dropout_prob / residual_droppath_prob /
      add_skip_connection / residual_weight: the residual branch, as in Praxis.
      gating_func: 'top2' (GShard top-2 with its per-group expert capacity, 'position'
        drops), 'dense_top2' (GShard top-2 without capacity: dropless) or 'topk'
        (dropless softmax top-`num_experts_per_token`).
      num_experts: E. num_groups / min_group_size: GShard's token groups; only 'top2' uses
        them (its capacity is per group). expert_capacity_dim /
        unadjusted_expert_capacity_factor: GShard's capacity per group,
        C = max(expert_capacity_dim, round_up_4(int(S * factor / E))), S = tokens per group.
      second_expert_policy: 'all' only (greedy second expert).
      moe_load_balance_loss_weight: coefficient of the load-balancing loss.
      gating_logit_cap: soft cap on the router logits (0 = off).
      internal_gshard_variance_scaling_fan_in_init: uniform(+-sqrt(3 / fan_in)) init (True)
        or normal(0, 1 / sqrt(fan_in)) (False).
      expert_weight_shards (must be 1), moe_gating_embedding_level (must be 'token'),
      explicit_fan_in_fan_out_axes (init only; accepted, no effect with our explicit inits).
    moe_praxis fields:
      num_experts_per_token: k for gating_func='topk' (top2 / dense_top2 need 2).
      aux_loss_type: 'gshard' (Praxis's top-1 density loss), 'switch' or 'sequence'.
      router_z_loss_weight: router z-loss coefficient (0 = off).
      kernel_backend: MoEConfig.kernel_backend ('auto', 'xla', 'cuda').
      mesh_resources: a moe_praxis.MeshResources; when set and a mesh is in scope
        (jax.set_mesh or `with mesh:`), moe_block runs expert-parallel on it.
      ep_exchange, ep_buffer_factor: MoEConfig's (expert-parallel token exchange).
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
    # moe_praxis fields.
    fuse_gate_up: bool = False
    num_experts_per_token: int = 2
    aux_loss_type: str = "gshard"
    router_z_loss_weight: float = 0.0
    kernel_backend: str = "auto"
    mesh_resources: Any = None
    ep_exchange: str = "auto"
    ep_buffer_factor: Optional[float] = None

    class WeightSharding(base_layer.BaseLayer.WeightSharding):
        """Weight sharding (mesh axis per dim).

        Attributes:
          me: router [M, E].
          emh: wi_up and wi_gate [E, M, H].
          ehm: wo [E, H, M].
        """

        me: SplitDimsMapping = None
        emh: SplitDimsMapping = None
        ehm: SplitDimsMapping = None

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

    def _validate(self) -> None:
        name = self.name
        err = lambda field, why: _setup_error(name, field, getattr(self, field), why)
        for field in ("input_dims", "hidden_dims", "num_experts"):
            v = getattr(self, field)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise err(field, "must be a positive int")
        if self.gating_func not in GATING_FUNCS:
            raise err("gating_func", f"valid: {GATING_FUNCS} ('expert_choice' routing is not "
                      "implemented)")
        if self.gating_func in ("top2", "dense_top2") and self.num_experts_per_token != 2:
            raise err(
                "num_experts_per_token", f"gating_func={self.gating_func!r} routes to 2 "
                "experts; use gating_func='topk' for another k")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise err("num_experts_per_token", f"must be in [1, num_experts={self.num_experts}]")
        if self.norm_policy not in NORM_POLICIES:
            raise err("norm_policy", f"valid: {NORM_POLICIES}")
        if self.relu_dropout_prob != 0.0:
            raise err(
                "relu_dropout_prob", "dropout on the experts' hidden activations is not "
                "implemented (moe_block has no dropout); set it to 0 (on a "
                "StackedTransformer set relu_dropout_prob=0 or dropout_prob=0)")
        for field in ("residual_dropout_prob", "residual_droppath_prob"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise err(field, "must be in [0, 1)")
        if self.residual_droppath_prob > 0 and not self.add_skip_connection:
            raise err("residual_droppath_prob", "drop-path needs add_skip_connection=True")
        if not isinstance(self.num_groups, (int, np.integer)) or self.num_groups < 1:
            raise err("num_groups", "must be a positive int")
        if self.min_group_size is not None and self.min_group_size < 1:
            raise err("min_group_size", "must be None or a positive int")
        if self.expert_capacity_dim < 0:
            raise err("expert_capacity_dim", "must be >= 0 (0 = from the capacity factor)")
        if self.unadjusted_expert_capacity_factor is not None and (
                self.unadjusted_expert_capacity_factor < 0):
            raise err("unadjusted_expert_capacity_factor", "must be >= 0")
        if self.gating_func == "top2" and not (self.unadjusted_expert_capacity_factor
                                               or self.expert_capacity_dim):
            raise err(
                "unadjusted_expert_capacity_factor", "gating_func='top2' needs a "
                "capacity: set it or expert_capacity_dim (or use 'dense_top2' for "
                "dropless routing)")
        if self.expert_weight_shards != 1:
            raise err("expert_weight_shards", "must be 1 (deprecated in Praxis as well)")
        if self.second_expert_policy != "all":
            raise err(
                "second_expert_policy", "only 'all' (greedy second expert); 'sampling' "
                "and 'random' are not implemented")
        if self.moe_gating_embedding_level != "token":
            raise err("moe_gating_embedding_level", "only 'token' routing is implemented")
        if self.moe_load_balance_loss_weight < 0:
            raise err("moe_load_balance_loss_weight", "must be >= 0")
        if self.gating_logit_cap < 0:
            raise err("gating_logit_cap", "must be >= 0 (0 = off)")
        if self.aux_loss_type not in AUX_LOSS_TYPES:
            raise err("aux_loss_type", f"valid: {AUX_LOSS_TYPES}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise err("kernel_backend", f"valid: {KERNEL_BACKENDS}")
        if self.router_z_loss_weight < 0:
            raise err("router_z_loss_weight", "must be >= 0")
        act_cls = self.activation_tpl.cls if self.activation_tpl is not None else None
        if act_cls not in ACTIVATIONS:
            raise _setup_error(name, "activation_tpl", getattr(act_cls, "__name__", act_cls),
                               f"valid: {sorted(c.__name__ for c in ACTIVATIONS)}")
        if act_cls is activations_lib.GELU and not self.activation_tpl.approximate:
            raise _setup_error(name, "activation_tpl.approximate", False,
                               "the experts' GELU is the tanh approximation")
        if self.mesh_resources is not None and not isinstance(self.mesh_resources, MeshResources):
            raise err("mesh_resources", "must be a moe_praxis.MeshResources or None")
        ranks = {"me": 2, "emh": 3, "ehm": 3}
        for field, rank in ranks.items():
            v = getattr(self.weight_split_dims_mapping, field)
            if v is not None and len(v) != rank:
                raise _setup_error(name, f"weight_split_dims_mapping.{field}", v,
                                   f"must have {rank} entries")
        ranks = {"gsm": 3, "gs": 2, "gsec": 4, "gecs": 4, "gec": 3, "egcm": 4, "egch": 4, "gecm": 4}
        for field, rank in ranks.items():
            v = getattr(self.activation_split_dims_mapping, field)
            if v is not None and len(v) != rank:
                raise _setup_error(name, f"activation_split_dims_mapping.{field}", v,
                                   f"must have {rank} entries")

    def moe_config(self, capacity_factor: Optional[float] = None) -> MoEConfig:
        """The MoEConfig this layer runs (capacity_factor None = dropless)."""
        return MoEConfig(
            d_model=int(self.input_dims),
            d_ff=int(self.hidden_dims),
            num_experts=int(self.num_experts),
            top_k=int(self.num_experts_per_token),
            score_func="softmax",
            pre_softmax=True,
            norm_topk=True,
            router_logit_cap=float(self.gating_logit_cap),
            aux_loss_type=self.aux_loss_type,
            aux_loss_coeff=float(self.moe_load_balance_loss_weight),
            z_loss_coeff=float(self.router_z_loss_weight),
            capacity_factor=capacity_factor,
            drop_policy="position",
            activation=ACTIVATIONS[self.activation_tpl.cls],
            gated=bool(self.use_gated_activation),
            fuse_gate_up=bool(self.fuse_gate_up),
            kernel_backend=self.kernel_backend,
            ep_exchange=self.ep_exchange,
            ep_buffer_factor=self.ep_buffer_factor,
        )

    def setup(self) -> None:
        self._validate()
        try:
            self.moe_config()  # MoEConfig validates the rest
        except ValueError as e:
            raise ValueError(f"MoEFeedForward {self.name!r}: {e}") from e

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

        wp = self.weight_split_dims_mapping

        def init(fan_in):
            if self.internal_gshard_variance_scaling_fan_in_init:
                return WeightInit.Uniform(math.sqrt(3.0 / fan_in))
            return WeightInit.Gaussian(1.0 / math.sqrt(fan_in))

        def var(name, shape, fan_in, split):
            self.create_variable(
                name,
                WeightHParams(shape=list(shape),
                              init=init(fan_in),
                              mesh_shape=self.mesh_shape,
                              tensor_split_dims_mapping=split))

        # The variables are moe_block's parameters (moe.param_shapes), created in this order;
        # emh's last entry also shards wi_gate_up's interleaved 2H (whole units per shard).
        shapes = param_shapes(self.moe_config())
        splits = {"router": wp.me, "wo": wp.ehm}  # the wi_* weights: emh
        for name in ("router", "wi_gate", "wi_up", "wi_gate_up", "wo"):
            if name in shapes:  # fan-in: the contracted dimension, shape[-2]
                var(name, shapes[name], shapes[name][-2], splits.get(name, wp.emh))

    # ------------------------------------------------------------------------- forward

    def _shard(self, x, split):
        return base_layer.maybe_shard(x, split, self.mesh_axis_names)

    def _token_split(self, ndim: int):
        gsm = self.activation_split_dims_mapping.gsm
        if gsm is None or ndim == 3:
            return gsm
        return [gsm[0], gsm[2]]  # [B, M] in extend_step

    def _capacity_and_groups(self, num_tokens: int):
        """GShard 'top2': (MoEConfig.capacity_factor, groups) giving C rows per expert per group."""
        if self.gating_func != "top2":
            return None, 1
        e, k = self.num_experts, self.num_experts_per_token
        # Expert parallel: the global batch is one group (moe_block's EP path applies one
        # capacity to the global batch, exactly as on one device).
        ep = self.mesh_resources is not None and compat.current_mesh() is not None
        groups = 1 if ep else int(self.num_groups)
        if self.min_group_size is not None and num_tokens / groups < self.min_group_size:
            groups = (num_tokens + self.min_group_size - 1) // self.min_group_size
        if num_tokens % groups:
            raise ValueError(f"MoEFeedForward {self.name!r}: num_groups={groups} does not divide "
                             f"the {num_tokens} tokens of the batch")
        s = num_tokens // groups
        c = int(self.expert_capacity_dim)
        if self.unadjusted_expert_capacity_factor:
            auto = int(s * self.unadjusted_expert_capacity_factor / e)
            if c < auto:
                c = (auto + 3) // 4 * 4
        if c < 1:
            raise ValueError(f"MoEFeedForward {self.name!r}: expert capacity is 0 for groups of "
                             f"{s} tokens (unadjusted_expert_capacity_factor="
                             f"{self.unadjusted_expert_capacity_factor}, expert_capacity_dim="
                             f"{self.expert_capacity_dim}); raise either")
        # MoEConfig.capacity(s) = ceil(cf * s * k / e) = ceil(c - 0.5) = c.
        return (c - 0.5) * e / (k * s), groups

    def _moe(self, x, paddings):
        """x: [..., M] normalised input; paddings: x.shape[:-1] or None.

        Returns (y [..., M], aux_loss [], z_loss [], tokens_per_expert [E], dropped []): with
        several GShard groups the losses are the groups' means and the counts their sums.
        """
        params = {name: self.theta[name] for name in param_shapes(self.moe_config())}
        token_shape = x.shape[:-1]
        num_tokens = int(np.prod(token_shape))
        cf, groups = self._capacity_and_groups(num_tokens)
        config = self.moe_config(cf)
        mesh = compat.current_mesh() if self.mesh_resources is not None else None
        if mesh is not None:
            out = moe_block(params,
                            x,
                            config,
                            mesh=mesh,
                            resources=self.mesh_resources,
                            paddings=paddings)
            return out.y, out.aux_loss, out.z_loss, out.tokens_per_expert, out.dropped_tokens
        if groups == 1:
            out = moe_block(params, x, config, paddings=paddings)
            return out.y, out.aux_loss, out.z_loss, out.tokens_per_expert, out.dropped_tokens
        if self.aux_loss_type == "sequence":
            raise ValueError(f"MoEFeedForward {self.name!r}: aux_loss_type='sequence' needs "
                             f"whole sequences; GShard token groups ({groups}) split them")
        # GShard 'top2' with several groups: each group routes (and fills its capacity) alone.
        xg = x.reshape(groups, num_tokens // groups, x.shape[-1])
        pg = (jnp.zeros(xg.shape[:2], x.dtype)
              if paddings is None else paddings.reshape(xg.shape[:2]))
        out = jax.lax.map(lambda a: moe_block(params, a[0], config, paddings=a[1]), (xg, pg))
        return (out.y.reshape(x.shape), jnp.mean(out.aux_loss), jnp.mean(out.z_loss),
                jnp.sum(out.tokens_per_expert, axis=0), jnp.sum(out.dropped_tokens))

    def _add_summaries(self, x, paddings, aux, zl, counts, dropped):
        """Scalar summaries (docs/praxis.md); x: [..., M] the router's input, no gradient."""
        config = self.moe_config()
        x2 = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
        valid = (jnp.ones((x2.shape[0], ), jnp.float32) if paddings is None else
                 (paddings.reshape(-1) < 0.5).astype(jnp.float32))
        n_valid = jnp.maximum(jnp.sum(valid), 1.0)
        logits = routing.router_logits(x2, jax.lax.stop_gradient(self.theta["router"]), config)
        logp = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        self.add_summary("moe_aux_loss", aux)
        self.add_summary("moe_z_loss", zl)
        self.add_summary("moe_router_entropy", jnp.sum(entropy * valid) / n_valid)
        copies = n_valid * config.top_k
        self.add_summary("moe_dropped_token_fraction", dropped.astype(jnp.float32) / copies)
        load = counts.astype(jnp.float32) / copies
        for i in range(config.num_experts):
            self.add_summary(f"moe_expert_load_{i}", load[i])

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
        y, aux, zl, counts, dropped = self._moe(x, paddings)
        y = self._shard(y, split)
        self._add_summaries(x, paddings, aux, zl, counts, dropped)
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
        self.add_aux_loss("aux_moe_load_balance_loss", aux.astype(jnp.float32))
        if self.router_z_loss_weight > 0:
            self.add_aux_loss("aux_moe_z_loss", zl.astype(jnp.float32))
        return y

    def extend_step(self, inputs: JTensor, *, time_step: JTensor) -> JTensor:
        """Decoding step: inputs [B, M] -> [B, M]."""
        del time_step
        return self.__call__(inputs)


# ----------------------------------------------------------------------------- converter


def _is_gshard_layer(tree) -> bool:
    return isinstance(tree, Mapping) and {"gate", "wi_0", "wo_0"} <= set(tree)


def _convert_layer(tree: Mapping, path: str) -> dict:
    gate, wi, wo = tree["gate"], tree["wi_0"], tree["wo_0"]
    if gate.ndim < 2 or wi.ndim != gate.ndim + 1 or wo.ndim != wi.ndim:
        raise ValueError(f"{path}: expected gate [..., M, E], wi_0 [..., E, M, H], wo_0 "
                         f"[..., E, H, M] with the same leading (repeat) dims; got gate "
                         f"{gate.shape}, wi_0 {wi.shape}, wo_0 {wo.shape}")
    lead = gate.shape[:-2]
    m, e = gate.shape[-2:]
    h = wi.shape[-1]
    want = {"wi_0": lead + (e, m, h), "wi_gate_0": lead + (e, m, h), "wo_0": lead + (e, h, m)}
    for name, shape in want.items():
        if name in tree and tuple(tree[name].shape) != shape:
            raise ValueError(f"{path}/{name} has shape {tuple(tree[name].shape)}; gate "
                             f"{tuple(gate.shape)} and wi_0 {tuple(wi.shape)} imply {shape}")
    out = {}
    for key, value in tree.items():
        out[GSHARD_PARAM_NAMES.get(key, key)] = value  # layer-norm children keep their names
    return out


def convert_gshard_params(params, *, fuse_gate_up: bool = False, _path: str = "params"):
    """Converts Praxis TransformerFeedForwardMoe parameters to MoEFeedForward's.

    `params` is either one layer's subtree or any nested dict holding such subtrees (a whole
    model's variables): every dict with the keys 'gate', 'wi_0', 'wo_0' is converted, the
    rest of the tree is returned unchanged (same leaves, new dicts). Per layer:

      gate      [..., M, E]    -> router  [..., M, E]
      wi_0      [..., E, M, H] -> wi_up   [..., E, M, H]
      wi_gate_0 [..., E, M, H] -> wi_gate [..., E, M, H]   (use_gated_activation only)
      wo_0      [..., E, H, M] -> wo      [..., E, H, M]
      layer_norm / pre_layer_norm / post_layer_norm: unchanged.

    fuse_gate_up=True (for MoEFeedForward(fuse_gate_up=True)): wi_gate_0 and wi_0 become one
    wi_gate_up [..., E, M, 2H], interleaved (moe_praxis.ops.interleave_gate_up); a layer
    without wi_gate_0 raises ValueError.

    `...` is the optional leading repeat dimension of StackedTransformerRepeated. The values
    are not copied or transformed: GShard's gate is already our router (logits = x @ gate)
    and MoEFeedForward with gating_func 'top2' / 'dense_top2' (second_expert_policy='all')
    computes GShard's routing: softmax over all experts, top-2, the two weights divided by
    their sum. Raises ValueError naming the path of a malformed layer.
    """
    if _is_gshard_layer(params):
        out = _convert_layer(params, _path)
        if fuse_gate_up:
            if "wi_gate" not in out:
                raise ValueError(f"{_path}: fuse_gate_up=True needs a gated layer (wi_gate_0), "
                                 f"found only {sorted(params)}")
            from moe_praxis.ops.gate_up import interleave_gate_up

            out["wi_gate_up"] = interleave_gate_up(out.pop("wi_gate"), out.pop("wi_up"))
        return out
    if isinstance(params, Mapping):
        return {
            k: convert_gshard_params(v, fuse_gate_up=fuse_gate_up, _path=f"{_path}/{k}")
            for k, v in params.items()
        }
    return params
