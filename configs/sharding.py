"""The model's sharding, written into an experiment config from its mesh.

``annotate(cfg)`` writes Praxis's canonical sharding into ``cfg.model`` (dense weights over fsdp
and tp, activations' batch over the token axes: ``TransformerLm.set_sharding_params_v1``) and
gives the MoE layers the mesh's ``MeshResources`` and the expert-weight split mappings
``me`` / ``emh`` / ``ehm`` (and the shared experts' ``mh`` / ``hm``) of
``EPLayout.weight_specs``. It runs when the experiment config is
built (``LanguageModel.experiment_config``) and again in the fiddlers that change the mesh
(``configs.experiments.use_mesh`` and friends), so it is part of the config: a later
``--fdl.model....weight_split_dims_mapping.emh=...`` override replaces what it wrote, and the
trainer reads the result as it is.

Every role is read through ``moe_praxis.MeshResources`` (``spec_entry``, ``token_axes``) and
``moe_praxis.ep_bootstrap``; nothing here interprets axis names. The split mappings depend on the
roles only, so the layout is taken on a mesh of the configured axis names with every size 1;
the sizes (and a ``-1`` axis) are checked by ``experiments.train.setup.prepare`` on the real mesh.
"""

from __future__ import annotations

import dataclasses

import fiddle as fdl
import jax

import moe_praxis
from praxis import pax_fiddle
from praxis.layers import transformer_models

from configs import base, models


def mesh_of(cfg: pax_fiddle.Config) -> base.MeshConfig:
    """The experiment's built MeshConfig (ValueError naming the bad field if it is invalid)."""
    mesh = cfg.mesh
    return fdl.build(mesh) if isinstance(mesh, fdl.Buildable) else mesh


def is_sharded(mesh: base.MeshConfig) -> bool:
    """Whether any axis plays fsdp, ep or tp (else weights are replicated)."""
    return mesh.resources.shards_weights


def annotate(cfg: pax_fiddle.Config) -> None:
    """Writes ``cfg.mesh``'s sharding into ``cfg.model`` (in place; see the module docstring).

    A data-parallel mesh needs none (weights replicated, the batch split by the jit input
    sharding), so nothing is written then, unless the model already carries the sharding of
    another mesh, which is overwritten with the data-parallel one.
    """
    mesh = mesh_of(cfg)
    model = cfg.model
    if not is_sharded(mesh) and model.mesh_axis_names is None:
        return
    resources = mesh.resources
    transformer_models.TransformerLm.set_sharding_params_v1(
        model,
        replica_axis=resources.spec_entry("dp"),
        data_axis=resources.spec_entry("fsdp"),
        mdl_axis=resources.spec_entry("tp"),
        ici_mesh_shape=list(mesh.shape),  # a -1 is resolved on the real mesh (prepare)
        mesh_axis_names=list(mesh.axis_names),
        batch_axes=resources.token_axes,
        training_optimized=True)
    block = models.stack_block(model)
    if not block.moe_layers:
        return
    roles_only = jax.sharding.AbstractMesh((1, ) * len(mesh.axis_names), mesh.axis_names)
    specs = moe_praxis.ep_bootstrap(roles_only, resources, block.num_experts).weight_specs
    moe = block.moe_layer_tpl
    # a sub-config, not the instance: it serializes, and --fdl can reach its fields
    moe.mesh_resources = fdl.Config(moe_praxis.MeshResources, **dataclasses.asdict(resources))
    moe.weight_split_dims_mapping.me = list(specs["router"])
    moe.weight_split_dims_mapping.emh = list(specs["wi_up"])
    moe.weight_split_dims_mapping.ehm = list(specs["wo"])
    if moe.num_shared_experts:  # the shared experts: a dense FFN's sharding
        moe.weight_split_dims_mapping.mh = list(specs["shared_wi_up"])
        moe.weight_split_dims_mapping.hm = list(specs["shared_wo"])
