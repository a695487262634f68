"""Mesh presets: a mesh shape, its axis names and the role of each axis (MeshResources).

Each returns ``fdl.Config(MeshConfig)``; ``-1`` is "every device the others leave". The roles
are interpreted in one place only, ``moe_praxis.resources`` (a built ``MeshConfig`` holds its
``MeshResources``; ``configs.sharding`` and the trainer ask ``ep_bootstrap`` for the expert
layout). Give one to an experiment with ``configs.experiments.use_mesh``, which also rewrites
the model's sharding.
"""

from __future__ import annotations

import fiddle as fdl

from configs.base import MeshConfig


def data_parallel() -> fdl.Config:
    """All devices on one 'data' axis (the default: whatever the machine has)."""
    return fdl.Config(MeshConfig, shape=(-1, ), axis_names=("data", ), dp="data")


def expert_parallel(ep: int) -> fdl.Config:
    """data (the rest) x expert (ep): tokens over both, experts split over 'expert'."""
    return fdl.Config(MeshConfig,
                      shape=(-1, ep),
                      axis_names=("data", "expert"),
                      dp="data",
                      ep="expert")


def fsdp_expert_parallel(dp: int, fsdp: int, ep: int, fsdp_dim: str = "expert") -> fdl.Config:
    """data x fsdp x expert. Expert weights: expert dim over (expert, fsdp) with
    fsdp_dim='expert', or expert dim over 'expert' and d_model over 'fsdp' with 'model'.
    Dense weights are sharded over 'fsdp' (Praxis's canonical sharding)."""
    return fdl.Config(MeshConfig,
                      shape=(dp, fsdp, ep),
                      axis_names=("data", "fsdp", "expert"),
                      dp="data",
                      fsdp="fsdp",
                      ep="expert",
                      fsdp_dim=fsdp_dim)
