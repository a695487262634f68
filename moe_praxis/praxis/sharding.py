"""The Praxis layer's weight sharding (``me`` / ``emh`` / ``ehm``, and ``mh`` / ``hm`` of the
shared experts) checked against its ``mesh_resources``: both describe where the MoE weights
live, and only ``resources.py`` interprets mesh roles, so the letters must equal what
``EPLayout.weight_specs`` derives.

No praxis import: the layer passes its fields in.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from moe_praxis.resources import MeshResources, ep_bootstrap

# Weight-sharding letter -> the parameter whose EPLayout.weight_specs entry it must equal
# (emh also shards wi_gate and wi_gate_up, whose specs are wi_up's).
LETTER_PARAMS = {
    "me": "router",
    "emh": "wi_up",
    "ehm": "wo",
    "mh": "shared_wi_up",
    "hm": "shared_wo"
}
EXPERT_LETTERS = ("emh", "ehm")  # letters whose first dim is the expert dimension
SHARED_LETTERS = ("mh", "hm")  # checked only when the layer has shared experts


def _entry(e) -> tuple:
    """A PartitionSpec / split-dims entry as a tuple of axis names (None -> ())."""
    if e is None:
        return ()
    if isinstance(e, str):
        return (e, )
    return tuple(e)


def _norm(mapping) -> tuple:
    return tuple(_entry(e) for e in mapping)


def checked_weight_splits(where: str,
                          resources: Optional[MeshResources],
                          mesh_axis_names,
                          mesh_shape,
                          given: dict,
                          *,
                          num_experts: int,
                          d_model: int,
                          d_ff: int,
                          shared_d_ff: Optional[int] = None) -> dict:
    """{letter: split dims mapping} for 'me', 'emh', 'ehm' (and, with shared experts of hidden
    width shared_d_ff, 'mh', 'hm'), checked against the layout.

    given: the layer's weight_split_dims_mapping letters (None = unset). Without
    mesh_resources or without the layer's mesh (mesh_axis_names and mesh_shape) there is no
    layout to check against and `given` is returned as is. Otherwise ep_bootstrap runs on an
    AbstractMesh of that shape; an unset letter takes the layout's spec, a set one must equal
    it. An expert dimension (emh, ehm) listing the layout's axes in another order is checked by
    ep_bootstrap as MeshResources.expert_dim_order: fsdp before ep gets its named error, an
    order that gathers the same experts (an axis of size 1) is accepted.
    Raises ValueError prefixed with `where`, naming the field, the value given and the value
    the layout needs.
    """
    if resources is None or mesh_axis_names is None or mesh_shape is None:
        return dict(given)
    mesh = jax.sharding.AbstractMesh(tuple(int(s) for s in mesh_shape), tuple(mesh_axis_names))
    bootstrap = lambda res: ep_bootstrap(
        mesh, res, num_experts, d_model=d_model, d_ff=d_ff, shared_d_ff=shared_d_ff)
    try:
        layout = bootstrap(resources)
    except ValueError as e:
        raise ValueError(f"{where}: mesh_resources={resources!r} on the layer's mesh "
                         f"{dict(mesh.shape)}: {e}") from e
    out = dict(given)
    for letter, param in LETTER_PARAMS.items():
        if letter in SHARED_LETTERS and not shared_d_ff:
            continue  # no shared weights to shard
        want = layout.weight_specs[param]
        value = given[letter]
        if value is None:
            out[letter] = list(want)
            continue
        got, need = _norm(value), _norm(want)
        if letter in EXPERT_LETTERS and got[0] != need[0] and sorted(got[0]) == sorted(need[0]):
            try:
                bootstrap(dataclasses.replace(resources, expert_dim_order=got[0]))
            except ValueError as e:
                raise ValueError(f"{where}: weight_split_dims_mapping.{letter}={value!r}: "
                                 f"{e}") from e
            need = (got[0], ) + need[1:]  # the same experts per EP rank
        if got != need:
            raise ValueError(
                f"{where}: weight_split_dims_mapping.{letter}={value!r} does not match the "
                f"layout of mesh_resources={resources!r} on the mesh {dict(mesh.shape)}: it "
                f"needs {list(want)!r} (EPLayout.weight_specs[{param!r}]); set that, or "
                "leave it None to take the layout's")
        out[letter] = value
    return out
