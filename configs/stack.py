"""What Praxis's stack writes on its MoE layer template, and the model checks Praxis asserts.

``StackedTransformer.setup`` (praxis/layers/transformers.py) makes each MoE layer from a clone
of ``moe_layer_tpl`` on which it sets its OWN ``num_experts``, ``num_groups``,
``min_group_size`` and ``gating_func``; ``Transformer.setup`` then sets the feed-forward layer's
``input_dims``, ``relu_dropout_prob``, ``residual_dropout_prob``, ``residual_droppath_prob``
and ``norm_policy`` from its own fields. A value written on the template for any of these never
reaches the layer, so:

- ``redirect_overrides`` applies a ``--fdl`` override of one of the stack's four fields on the
  template where the stack reads it (the stack's own field), so it takes effect;
- ``check`` refuses any other template value the stack would overwrite, naming where to set it,
  checks what Praxis only asserts (the stack's model_dims against the LM's, sizes, dropout
  probabilities), and validates every MoE layer as the stack will build it
  (``moe_praxis.praxis.fields``), so these errors come before anything is traced.
"""

from __future__ import annotations

import copy
import re

import fiddle as fdl
from fiddle import daglish
from fiddle._src.absl_flags import utils as fdl_utils
from praxis import pax_fiddle

from configs import models
from moe_praxis.praxis import fields

# The fields StackedTransformer copies from itself onto every MoE layer (same names).
STACK_FIELDS = ("num_experts", "num_groups", "min_group_size", "gating_func")
_TEMPLATE_FIELD = re.compile(rf"^(.+)\.moe_layer_tpl\.({'|'.join(STACK_FIELDS)})$")


def _stack_path(lm) -> str:
    block = models.stack_block(lm)
    return "model.stacked_transformer_tpl" + (".block"
                                              if block is not lm.stacked_transformer_tpl else "")


def _layer_tpl(block, i: int):
    tpl = block.transformer_layer_params_tpl
    if isinstance(tpl, (list, tuple)):
        return tpl[i // max(1, block.num_layers // len(tpl))]
    return tpl


def set_by_stack(lm, i: int) -> dict:
    """``{field: (value, where it comes from)}``: what the stack sets on MoE layer ``i``."""
    block, at = models.stack_block(lm), _stack_path(lm)
    out = {f: (getattr(block, f), f"{at}.{f}") for f in STACK_FIELDS}
    dense = "; it also sets the dense layers'"
    out["input_dims"] = (lm.model_dims, "model.model_dims")
    out["relu_dropout_prob"] = (block.relu_dropout_prob or block.dropout_prob,
                                f"{at}.relu_dropout_prob (or {at}.dropout_prob{dense})")
    out["residual_dropout_prob"] = (block.residual_dropout_prob or block.dropout_prob,
                                    f"{at}.residual_dropout_prob (or {at}.dropout_prob{dense})")
    out["residual_droppath_prob"] = (block.residual_droppath_prob * i / max(1, block.num_layers),
                                     f"{at}.residual_droppath_prob (scaled by layer)")
    out["norm_policy"] = (_layer_tpl(block, i).norm_policy,
                          f"{at}.transformer_layer_params_tpl.norm_policy")
    return out


def template_fields_set_by_stack(lm) -> dict:
    """``{path: (value, where it comes from)}``: the MoE template's fields (full config paths,
    ``model.stacked_transformer_tpl.moe_layer_tpl.num_experts``) that the stack overwrites on
    its first MoE layer; empty without MoE layers."""
    block = models.stack_block(lm)
    if not block.moe_layers:
        return {}
    at = _stack_path(lm)
    return {
        f"{at}.moe_layer_tpl.{f}": v
        for f, v in set_by_stack(lm, min(block.moe_layers)).items()
    }


def moe_layer_configs(lm) -> list:
    """``[(i, config)]``: each MoE layer's config as the stack makes it (unbuilt)."""
    block = models.stack_block(lm)
    out = []
    for i in block.moe_layers or []:
        moe = copy.deepcopy(block.moe_layer_tpl)
        for field, (value, _) in set_by_stack(lm, i).items():
            setattr(moe, field, value)
        if not moe.hidden_dims:
            moe.hidden_dims = block.hidden_dims
        moe.name = f"layer_{i}.ff_layer"
        out.append((i, moe))
    return out


def redirect_overrides(cfg, paths) -> None:
    """For each override path ``<stack>.moe_layer_tpl.<f>`` (``f`` in STACK_FIELDS) of the
    experiment config ``cfg``, sets the stack's own ``f`` to the template's value, where the
    stack reads it. Raises ValueError when the same overrides also set the stack's ``f`` to
    another value."""
    paths = list(paths)
    for path in paths:
        m = _TEMPLATE_FIELD.match(path)
        if not m:
            continue
        parent, field = m.groups()
        stack = daglish.follow_path(cfg, fdl_utils.parse_path(parent))
        if not (isinstance(stack, fdl.Buildable) and field in stack.__signature_info__.parameters
                and "moe_layer_tpl" in stack.__signature_info__.parameters):
            continue
        value = getattr(stack.moe_layer_tpl, field)
        if f"{parent}.{field}" in paths and getattr(stack, field) != value:
            raise ValueError(f"--fdl.{path}={value!r} and --fdl.{parent}.{field}="
                             f"{getattr(stack, field)!r} disagree; the stack sets {field} on "
                             f"every MoE layer from its own field: set only --fdl.{parent}."
                             f"{field}")
        setattr(stack, field, value)


def _check_praxis_asserts(lm) -> None:
    block, at = models.stack_block(lm), _stack_path(lm)
    if block.model_dims not in (0, lm.model_dims):
        raise ValueError(f"model.model_dims={lm.model_dims} differs from {at}.model_dims="
                         f"{block.model_dims}: TransformerLm gives the stack its own model_dims "
                         f"and needs the stack's to be equal (or 0); set both (--fdl.model."
                         f"model_dims and --fdl.{at}.model_dims)")
    for field in ("num_layers", "hidden_dims", "num_heads"):
        v = getattr(block, field)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{at}.{field}={v!r} is invalid: must be a positive int")
    if not isinstance(lm.model_dims, int) or lm.model_dims < 1:
        raise ValueError(f"model.model_dims={lm.model_dims!r} is invalid: must be a positive int")
    for field in ("dropout_prob", "input_dropout_prob", "atten_dropout_prob",
                  "residual_dropout_prob", "relu_dropout_prob"):
        v = getattr(block, field)
        if v is not None and not 0.0 <= v < 1.0:
            raise ValueError(f"{at}.{field}={v!r} is invalid: must be in [0, 1)")


def check(lm) -> None:
    """Checks a TransformerLm config before anything is built or traced: Praxis's asserted
    invariants, template fields the stack would overwrite, and each MoE layer's fields as the
    stack will set them. Raises ValueError (one line, naming the field and where to set it)."""
    _check_praxis_asserts(lm)
    block, at = models.stack_block(lm), _stack_path(lm)
    tpl = block.moe_layer_tpl
    if not block.moe_layers:
        return
    for i, moe in moe_layer_configs(lm):
        for field, (value, where) in set_by_stack(lm, i).items():
            if field in tpl.__arguments__ and getattr(tpl, field) != value:
                raise ValueError(f"{at}.moe_layer_tpl.{field}={getattr(tpl, field)!r} has no "
                                 f"effect: the stack sets {field} on MoE layer {i} from "
                                 f"{where} (= {value!r}); set it there")
        layer = pax_fiddle.build(moe)  # unbound: setup (and tracing) has not run
        fields.validate(layer)
        fields.build_config(layer)
