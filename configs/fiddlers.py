"""Fiddlers: functions that edit an experiment config (``--fiddler='use_expert_parallel(ep=4)'``;
``configs.experiments`` re-exports them, the module --fiddler names are resolved in)."""

from __future__ import annotations

from typing import Optional

import fiddle as fdl
from praxis import pax_fiddle

from configs import meshes, sharding


def use_synthetic_data(cfg: pax_fiddle.Config) -> None:
    """Fiddler (--fiddler=use_synthetic_data): switch the data source to synthetic."""
    cfg.data.source = "synthetic"


def use_mesh(cfg: pax_fiddle.Config, mesh: Optional[fdl.Config] = None, **fields) -> None:
    """Fiddler (--fiddler='use_mesh(shape=(4, 2))'): set the experiment's mesh and rewrite the
    model's sharding for it.

    mesh: a ``fdl.Config(MeshConfig)`` (e.g. from ``configs.meshes``) replacing the mesh;
    fields: MeshConfig fields changed on the (new) mesh (shape, axis_names, dp, fsdp, ep, tp,
    fsdp_dim). Change the mesh this way rather than by ``--fdl.mesh.X=`` overrides, which come
    after the model's sharding was written: the trainer refuses a model sharded for another
    mesh than the experiment's.
    """
    if mesh is not None:
        cfg.mesh = mesh
    for name, value in fields.items():
        setattr(cfg.mesh, name, value)
    sharding.annotate(cfg)


def use_expert_parallel(cfg: pax_fiddle.Config, ep: int = 2) -> None:
    """Fiddler (--fiddler='use_expert_parallel(ep=4)'): mesh data (the rest) x expert (ep)."""
    use_mesh(cfg, meshes.expert_parallel(ep))


def use_fsdp_expert_parallel(cfg: pax_fiddle.Config,
                             dp: int = 2,
                             fsdp: int = 2,
                             ep: int = 2,
                             fsdp_dim: str = "expert") -> None:
    """Fiddler (--fiddler='use_fsdp_expert_parallel(dp=2, fsdp=2, ep=2)'): data x fsdp x
    expert mesh."""
    use_mesh(cfg, meshes.fsdp_expert_parallel(dp, fsdp, ep, fsdp_dim))
