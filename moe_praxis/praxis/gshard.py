"""GShard (Praxis's TransformerFeedForwardMoe): its parameter names, its capacity rule, its
token groups run through moe_block, and the checkpoint converter to MoEFeedForward's
parameters. Pure Python and JAX: no praxis import.

Letters: M model dim, H hidden dim, E experts, k experts per token; S tokens per GShard group,
C expert capacity per group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import dataclasses

import jax
import jax.numpy as jnp

from moe_praxis.config import MoEConfig
from moe_praxis.moe import MoEOutput, moe_block
from moe_praxis.ops import interleave_gate_up

# The parameter names of Praxis's TransformerFeedForwardMoe -> ours (moe_block's).
GSHARD_PARAM_NAMES = {"gate": "router", "wi_0": "wi_up", "wi_gate_0": "wi_gate", "wo_0": "wo"}


def capacity_and_groups(num_tokens: int, *, num_experts: int, top_k: int, num_groups: int,
                        min_group_size: Optional[int], expert_capacity_dim: int,
                        capacity_factor: Optional[float], where: str) -> tuple[float, int]:
    """GShard 'top2': (MoEConfig.capacity_factor, groups) giving C rows per expert per group.

    groups = num_groups, fewer when a group would hold less than min_group_size tokens;
    C = max(expert_capacity_dim, round_up_4(int(S * capacity_factor / E))), S = T / groups
    (GShard's formula). MoEConfig.capacity(S) = ceil(cf * S * k / E) = ceil(C - 0.5) = C.
    `where` prefixes the errors (the layer's name).
    """
    e, k, groups = num_experts, top_k, int(num_groups)
    if min_group_size is not None and num_tokens / groups < min_group_size:
        groups = (num_tokens + min_group_size - 1) // min_group_size
    if num_tokens % groups:
        raise ValueError(f"{where}: num_groups={groups} does not divide the {num_tokens} tokens "
                         "of the batch")
    s = num_tokens // groups
    c = int(expert_capacity_dim)
    if capacity_factor:
        auto = int(s * capacity_factor / e)
        if c < auto:
            c = (auto + 3) // 4 * 4
    if c < 1:
        raise ValueError(f"{where}: expert capacity is 0 for groups of {s} tokens "
                         f"(unadjusted_expert_capacity_factor={capacity_factor}, "
                         f"expert_capacity_dim={expert_capacity_dim}); raise either")
    return (c - 0.5) * e / (k * s), groups


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
            out["wi_gate_up"] = interleave_gate_up(out.pop("wi_gate"), out.pop("wi_up"))
        return out
    if isinstance(params, Mapping):
        return {
            k: convert_gshard_params(v, fuse_gate_up=fuse_gate_up, _path=f"{_path}/{k}")
            for k, v in params.items()
        }
    return params


def grouped_moe_block(params: dict, x, config: MoEConfig, groups: int, paddings=None) -> MoEOutput:
    """GShard 'top2' with several token groups: x [..., M] (T tokens) split into `groups` groups
    of T / groups consecutive tokens, each routed by moe_block alone (filling its own
    capacity, config.capacity(S)). Returns one MoEOutput: y in x's shape, the losses and the
    router entropy the groups' means, the counts their sums."""
    num_tokens = x.size // x.shape[-1]
    xg = x.reshape(groups, num_tokens // groups, x.shape[-1])
    pg = (jnp.zeros(xg.shape[:2], x.dtype) if paddings is None else paddings.reshape(xg.shape[:2]))
    out = jax.lax.map(lambda a: moe_block(params, a[0], config, paddings=a[1]), (xg, pg))
    return dataclasses.replace(out,
                               y=out.y.reshape(x.shape),
                               aux_loss=jnp.mean(out.aux_loss),
                               z_loss=jnp.mean(out.z_loss),
                               tokens_per_expert=jnp.sum(out.tokens_per_expert, axis=0),
                               dropped_tokens=jnp.sum(out.dropped_tokens),
                               router_entropy=jnp.mean(out.router_entropy))
