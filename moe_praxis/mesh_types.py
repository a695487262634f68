"""Mesh axis types (Auto, Explicit, Manual): how a mesh describes itself and whether it may
be used where another mesh is in scope. No mesh roles are read here (resources.py does that);
resources.py re-exports these names.
"""

from __future__ import annotations

import jax


def axis_types(mesh) -> dict:
    """{axis name: 'Auto' | 'Explicit' | 'Manual'} of a Mesh or AbstractMesh ({} for None)."""
    if mesh is None:
        return {}
    return {a: getattr(t, "name", str(t)) for a, t in zip(mesh.axis_names, mesh.axis_types)}


def describe_mesh(mesh) -> str:
    """'data2 x expert4 (Explicit, Explicit)': a mesh's axes, sizes and axis types."""
    shape = dict(mesh.shape)
    axes = " x ".join(f"{a}{shape[a]}" for a in mesh.axis_names)
    return f"{axes} (axis types {tuple(axis_types(mesh).values())})"


def check_mesh_in_scope(mesh) -> None:
    """Raises ValueError, naming both meshes' axis types, for a mesh other than the one in scope
    (jax.set_mesh, or an enclosing shard_map), which shard_map refuses unless both are Auto."""
    scope = jax.sharding.get_abstract_mesh()
    if scope.empty or mesh.abstract_mesh == scope:
        return
    if set(axis_types(mesh).values()) | set(axis_types(scope).values()) == {"Auto"}:
        return
    raise ValueError(f"the mesh {describe_mesh(mesh)} differs from the mesh in scope "
                     f"{describe_mesh(scope)} (set by jax.set_mesh, or Manual inside a "
                     "shard_map): pass the mesh in scope, mesh=jax.sharding.get_abstract_mesh(), "
                     "or call outside jax.set_mesh")
