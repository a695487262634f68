"""MoEFeedForward's fields: the layer-only checks, and the one MoEConfig the others map to.

MoEConfig validates the fields it holds (its errors are re-raised naming the layer and the
layer's field); `validate` checks only what MoEConfig does not see: Praxis's gating, norm,
dropout and GShard-group fields, the activation template, mesh_resources' type and the ranks
of the sharding letters.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from praxis.layers import activations as activations_lib

from moe_praxis.config import MoEConfig
from moe_praxis.resources import MeshResources

GATING_FUNCS = ("top2", "dense_top2", "topk")
NORM_POLICIES = ("pre", "post", "primer_hybrid", "post_skip")
# Praxis activation layer class -> MoEConfig.activation.
ACTIVATIONS = {
    activations_lib.ReLU: "relu",
    activations_lib.GELU: "gelu",  # approximate=True only (jax.nn.gelu's default)
    activations_lib.SiLU: "silu",
    activations_lib.Swish: "silu",  # jax.nn.swish is jax.nn.silu
}
# MoEConfig field -> the layer field that sets it (MoEConfig's errors are reported with both).
CONFIG_FIELDS = {
    "d_model": "input_dims",
    "d_ff": "hidden_dims",
    "num_experts": "num_experts",
    "top_k": "num_experts_per_token",
    "router_logit_cap": "gating_logit_cap",
    "aux_loss_type": "aux_loss_type",
    "aux_loss_coeff": "moe_load_balance_loss_weight",
    "z_loss_coeff": "router_z_loss_weight",
    "gated": "use_gated_activation",
    "fuse_gate_up": "fuse_gate_up",
    "kernel_backend": "kernel_backend",
    "router_precision": "router_precision",
    "ep_exchange": "ep_exchange",
    "ep_buffer_factor": "ep_buffer_factor",
    "score_func": "score_func",
    "pre_softmax": "pre_softmax",
    "norm_topk": "norm_topk",
    "num_expert_groups": "num_expert_groups",
    "group_topk": "group_topk",
    "use_expert_bias": "use_expert_bias",
    "expert_bias_update_rate": "expert_bias_update_rate",
    "routed_scaling_factor": "routed_scaling_factor",
    "capacity_factor": "capacity_factor",
    "drop_policy": "drop_policy",
    "num_shared_experts": "num_shared_experts",
    "shared_d_ff": "shared_hidden_dims",
    "shared_expert_gate": "shared_expert_gate",
    "fp8": "fp8",
    "fp8_quantize_before_gather": "fp8_quantize_before_gather",
    "fp8_gemms": "fp8_gemms",
    "regather_rows": "regather_rows",
}
# MoEConfig field -> its declared type ('int', 'bool', 'Optional[float]', ...), from the dataclass.
CONFIG_TYPES = {f.name: str(f.type) for f in dataclasses.fields(MoEConfig)}
# The layer's defaults that differ from MoEConfig's, declared here once: GShard's layer contract
# (Praxis's GShard MoE: softmax top-2 density loss with weight 1.0, no gated activation) and the
# fields a layer sets from its model (0: required). Every other mapped field's default is
# MoEConfig's (tests/test_praxis_layer.py keeps the layer's declarations in step).
GSHARD_OVERRIDES = {
    "d_model": 0,
    "d_ff": 0,
    "num_experts": 0,
    "aux_loss_type": "gshard",
    "aux_loss_coeff": 1.0,
    "gated": False,
}


def config_default(layer_field: str):
    """MoEConfig's default of the field that MoEFeedForward's ``layer_field`` sets (through
    CONFIG_FIELDS), before the layer's GShard overrides: what an experiment knob of that field
    starts from. KeyError for a layer field that sets no MoEConfig field."""
    if layer_field not in _DEFAULT_BY_LAYER_FIELD:
        raise KeyError(f"MoEFeedForward.{layer_field} sets no MoEConfig field (valid: "
                       f"{', '.join(sorted(_DEFAULT_BY_LAYER_FIELD))})")
    return _DEFAULT_BY_LAYER_FIELD[layer_field]


_DEFAULT_BY_LAYER_FIELD = {
    CONFIG_FIELDS[f.name]: f.default
    for f in dataclasses.fields(MoEConfig) if f.name in CONFIG_FIELDS
}

# The routing fields only gating_func='topk' honours, with the value 'top2' / 'dense_top2' route
# with (GShard's softmax top-2; 'top2' takes its capacity from the GShard fields instead).
TOPK_ONLY = {
    "score_func": "softmax",
    "pre_softmax": True,
    "norm_topk": True,
    "num_expert_groups": 1,
    "group_topk": 1,
    "use_expert_bias": False,
    "expert_bias_update_rate": 0.0,
    "routed_scaling_factor": 1.0,
    "capacity_factor": None,
    "drop_policy": "position",
}
# moe_block's parameters (moe.param_shapes) -> the weight-sharding letter that shards each, in
# the layer's creation order; None = replicated. emh's last entry also shards wi_gate_up's
# interleaved 2H (whole units per shard). expert_bias is a NON_TRAINABLE variable, not here.
VARIABLE_LETTERS = {
    "router": "me",
    "wi_gate": "emh",
    "wi_up": "emh",
    "wi_gate_up": "emh",
    "wo": "ehm",
    "shared_wi_gate": "mh",
    "shared_wi_up": "mh",
    "shared_wo": "hm",
    "shared_gate": None,
}
WEIGHT_RANKS = {"me": 2, "emh": 3, "ehm": 3, "mh": 2, "hm": 2}
ACTIVATION_RANKS = dict(gsm=3, gs=2, gsec=4, gecs=4, gec=3, egcm=4, egch=4, gecm=4)


def _setup_error(layer: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"MoEFeedForward {layer!r}: {field}={value!r} is not supported: {why}.")


def _int(v):
    """numpy integers as int; anything else unchanged, for MoEConfig to refuse by name."""
    return int(v) if isinstance(v, np.integer) else v


def _converted(name: str, value):
    """A layer field's value as MoEConfig field `name` takes it: numpy integers as int for the
    int fields, bool() for the bool ones (MoEConfig refuses anything else by name)."""
    kind = CONFIG_TYPES[name]
    if kind in ("int", "Optional[int]"):
        return _int(value)
    if kind == "bool":
        return bool(value)
    return value


def validate(layer) -> None:
    """The layer-only fields (MoEConfig validates the fields it holds)."""
    name = layer.name
    err = lambda field, why: _setup_error(name, field, getattr(layer, field), why)
    if layer.gating_func not in GATING_FUNCS:
        raise err("gating_func", f"valid: {GATING_FUNCS} ('expert_choice' routing is not "
                  "implemented)")
    if layer.gating_func in ("top2", "dense_top2") and layer.num_experts_per_token != 2:
        raise err(
            "num_experts_per_token", f"gating_func={layer.gating_func!r} routes to 2 "
            "experts; use gating_func='topk' for another k")
    if layer.gating_func != "topk":
        for field, gshard in TOPK_ONLY.items():
            if getattr(layer, field) != gshard:
                raise err(
                    field, f"gating_func={layer.gating_func!r} is GShard's softmax top-2 and "
                    f"routes with {field}={gshard!r}; use gating_func='topk' for this option")
    scale = layer.router_init_scale
    if isinstance(scale, bool) or not isinstance(
            scale, (int, float, np.floating)) or not (math.isfinite(scale) and scale > 0):
        raise err("router_init_scale", "must be a finite number > 0 (1: the fan-in init)")
    if layer.norm_policy not in NORM_POLICIES:
        raise err("norm_policy", f"valid: {NORM_POLICIES}")
    if layer.relu_dropout_prob != 0.0:
        raise err(
            "relu_dropout_prob", "dropout on the experts' hidden activations is not "
            "implemented (moe_block has no dropout); set it to 0 (on a "
            "StackedTransformer set relu_dropout_prob=0 or dropout_prob=0)")
    for field in ("residual_dropout_prob", "residual_droppath_prob"):
        if not 0.0 <= getattr(layer, field) < 1.0:
            raise err(field, "must be in [0, 1)")
    if layer.residual_droppath_prob > 0 and not layer.add_skip_connection:
        raise err("residual_droppath_prob", "drop-path needs add_skip_connection=True")
    if not isinstance(layer.num_groups, (int, np.integer)) or layer.num_groups < 1:
        raise err("num_groups", "must be a positive int")
    if layer.min_group_size is not None and layer.min_group_size < 1:
        raise err("min_group_size", "must be None or a positive int")
    if layer.expert_capacity_dim < 0:
        raise err("expert_capacity_dim", "must be >= 0 (0 = from the capacity factor)")
    if layer.unadjusted_expert_capacity_factor is not None and (
            layer.unadjusted_expert_capacity_factor < 0):
        raise err("unadjusted_expert_capacity_factor", "must be >= 0")
    if layer.gating_func == "top2" and not (layer.unadjusted_expert_capacity_factor
                                            or layer.expert_capacity_dim):
        raise err(
            "unadjusted_expert_capacity_factor", "gating_func='top2' needs a "
            "capacity: set it or expert_capacity_dim (or use 'dense_top2' for "
            "dropless routing)")
    if layer.expert_weight_shards != 1:
        raise err("expert_weight_shards", "must be 1 (deprecated in Praxis as well)")
    if layer.second_expert_policy != "all":
        raise err(
            "second_expert_policy", "only 'all' (greedy second expert); 'sampling' "
            "and 'random' are not implemented")
    if layer.moe_gating_embedding_level != "token":
        raise err("moe_gating_embedding_level", "only 'token' routing is implemented")
    act_cls = layer.activation_tpl.cls if layer.activation_tpl is not None else None
    if act_cls not in ACTIVATIONS:
        raise _setup_error(name, "activation_tpl", getattr(act_cls, "__name__", act_cls),
                           f"valid: {sorted(c.__name__ for c in ACTIVATIONS)}")
    if act_cls is activations_lib.GELU and not layer.activation_tpl.approximate:
        raise _setup_error(name, "activation_tpl.approximate", False,
                           "the experts' GELU is the tanh approximation")
    if layer.mesh_resources is not None and not isinstance(layer.mesh_resources, MeshResources):
        raise err("mesh_resources", "must be a moe_praxis.MeshResources or None")
    for group, ranks in (("weight", WEIGHT_RANKS), ("activation", ACTIVATION_RANKS)):
        mapping = getattr(layer, f"{group}_split_dims_mapping")
        for field, rank in ranks.items():
            v = getattr(mapping, field, None)  # a GShard template switched in place lacks ours
            if v is not None and len(v) != rank:
                raise _setup_error(name, f"{group}_split_dims_mapping.{field}", v,
                                   f"must have {rank} entries")


def build_config(layer) -> MoEConfig:
    """The one MoEConfig of this layer: 'topk' with its capacity_factor (None = dropless),
    'top2' / 'dense_top2' dropless ('top2' swaps in GShard's capacity per call).

    MoEConfig's ValueError is re-raised with the layer's name and the layer field."""
    values = {
        name: _converted(name, getattr(layer, field))
        for name, field in CONFIG_FIELDS.items()
    }
    try:
        return MoEConfig(**values, activation=ACTIVATIONS[layer.activation_tpl.cls])
    except ValueError as e:
        found = re.match(r"MoEConfig\.(\w+)=", str(e))
        field = CONFIG_FIELDS.get(found.group(1)) if found else None
        where = f" (the layer's {field}={getattr(layer, field)!r})" if field else ""
        raise ValueError(f"MoEFeedForward {layer.name!r}: {e}{where}") from e
