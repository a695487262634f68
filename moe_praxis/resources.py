"""Mesh roles for expert parallelism: MeshResources, ep_bootstrap and EPLayout.

This module is the ONLY place that interprets mesh axis names. Everything else asks the
EPLayout that `ep_bootstrap` returns.

Roles (each a mesh axis name, a tuple of names, or None):
  dp    data parallel: tokens are split over it, weights are replicated.
  fsdp  fully sharded data parallel: tokens are split over it AND expert weights are sharded
        over it (on the expert dimension after ep, or on the d_model dimension); the block
        all-gathers the weights over fsdp, so their gradients come back reduce-scattered.
  ep    expert parallel: tokens are split over it and EP rank r owns the contiguous experts
        [r * E / ep, (r + 1) * E / ep); tokens travel to their experts' rank and back.
  tp    tensor parallel on the expert hidden dimension H (gate/up columns, down rows); the
        partial expert outputs are summed over tp. Tokens are replicated over tp.

Token axes are dp, fsdp and ep together, in that order (a token's shard index is the
row-major index over them). `num_ep_groups` is the product of the sizes of every token axis
that is not ep (dp x fsdp): the ep ranks of one group exchange tokens with each other.

Expert-weight layout. With fsdp on the expert dimension (the default, `fsdp_dim='expert'`) the
expert dimension of wi_gate / wi_up [E, M, H] and wo [E, H, M] is sharded over
`ep_axes + fsdp_axes` (ep before fsdp), so gathering over fsdp gives each EP rank its
contiguous experts. fsdp before ep would not: with 8 experts on EP2 x FSDP2, EP rank 0 would
gather experts [0, 1, 4, 5]. Such a layout, given in `expert_dim_order`, is refused.
With `fsdp_dim='model'` the expert dimension is sharded over ep only and fsdp shards the
d_model dimension M (wi: [E, M/fsdp, H], wo: [E, H, M/fsdp]).

Mesh axis types: Explicit (`jax.make_mesh`'s default), Auto (`jax.sharding.Mesh`) or both. On
Explicit axes shard_map checks an input's type against its in_specs, so the block first gives
each input its spec's sharding there (`EPLayout.explicit_spec`). Manual role axes are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_praxis.mesh_types import axis_types, check_mesh_in_scope, describe_mesh  # noqa: F401

AxisNames = Union[None, str, tuple]
ROLES = ("dp", "fsdp", "ep", "tp")
FSDP_DIMS = ("expert", "model")


def _as_tuple(role: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value, )
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        if len(set(value)) != len(value):
            raise ValueError(f"MeshResources.{role}={value!r} names an axis twice")
        return tuple(value)
    raise ValueError(f"MeshResources.{role}={value!r} is invalid: use a mesh axis name, a tuple "
                     "of names, or None")


@dataclasses.dataclass(frozen=True)
class MeshResources:
    """Which mesh axis (or tuple of axes, or None) plays each parallelism role.

    Fields:
      dp, fsdp, ep, tp: see the module docstring.
      fsdp_dim: where fsdp shards the expert weights: 'expert' (the expert dimension, after ep:
        `P(ep + fsdp, ...)`) or 'model' (the d_model dimension M).
      expert_dim_order: optional, the mesh axes on the expert dimension of the expert weights
        in the order the user's own weight sharding lists them (a PartitionSpec entry such as
        ('ep', 'fsdp')). None = ep axes then fsdp axes. An order that would not give each EP
        rank its contiguous experts after the fsdp gather is refused by ep_bootstrap.
    """

    dp: AxisNames = None
    fsdp: AxisNames = None
    ep: AxisNames = None
    tp: AxisNames = None
    fsdp_dim: str = "expert"
    expert_dim_order: Optional[tuple] = None

    def __post_init__(self):
        seen = {}
        for role in ROLES:
            for a in _as_tuple(role, getattr(self, role)):
                if a in seen:
                    raise ValueError(f"mesh axis {a!r} is given two roles, MeshResources."
                                     f"{seen[a]} and MeshResources.{role}: axis {a!r} already "
                                     f"plays {seen[a]!r}; an axis plays one role")
                seen[a] = role
        if self.fsdp_dim not in FSDP_DIMS:
            raise ValueError(f"MeshResources.fsdp_dim={self.fsdp_dim!r} is invalid; valid: "
                             f"{FSDP_DIMS}")
        if self.expert_dim_order is not None:
            _as_tuple("expert_dim_order", self.expert_dim_order)

    def axes(self, role: str) -> tuple[str, ...]:
        """The mesh axes of `role` ('dp' | 'fsdp' | 'ep' | 'tp') as a tuple (maybe empty)."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} is invalid; valid: {ROLES}")
        return _as_tuple(role, getattr(self, role))

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes tokens are split over: dp, fsdp and ep together, in that order (a token
        shard's index is row-major over them)."""
        return self.axes("dp") + self.axes("fsdp") + self.axes("ep")

    @property
    def shards_weights(self) -> bool:
        """Whether any axis plays fsdp, ep or tp (with dp alone every weight is replicated)."""
        return bool(self.axes("fsdp") or self.axes("ep") or self.axes("tp"))

    def spec_entry(self, role: str):
        """The PartitionSpec entry of `role`: None, its one axis name, or a tuple of names."""
        return _entry(self.axes(role))

    def check_axis_names(self, axis_names) -> None:
        """Checks every role's axes against a mesh's axis names, without a mesh.

        axis_names: the mesh's axis names (a sequence of distinct str). Raises ValueError
        naming the role and the axis that is not a mesh axis. (An axis given two roles is
        refused when the MeshResources is built.)
        """
        names = tuple(axis_names)
        if len(set(names)) != len(names):
            raise ValueError(f"axis_names={names!r} names an axis twice; mesh axis names are "
                             "distinct")
        for role in ROLES:
            for a in self.axes(role):
                if a not in names:
                    raise ValueError(f"MeshResources.{role}={getattr(self, role)!r} is invalid: "
                                     f"axis {a!r} is not a mesh axis; axes are {names}")


def _entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for `axes`: None, one name, or a tuple of names."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """What ep_bootstrap derived from a mesh and its MeshResources.

    Sizes: dp_size, fsdp_size, ep_size, tp_size (products over each role's axes);
    num_token_shards = dp * fsdp * ep; num_ep_groups = dp * fsdp (every token axis that is not
    ep); experts_per_rank = E / ep.
    Axes: dp_axes, fsdp_axes, ep_axes, tp_axes; token_axes = dp + fsdp + ep (row-major order of
    a token shard's index).
    Specs: token_spec shards dim 0 of x [T, M] (and valid [T]) over the token axes;
    expert_spec is the PartitionSpec of the expert dimension alone; weight_specs maps each
    parameter name to its full PartitionSpec.
    explicit_axes: the mesh's Explicit axes; an input of spec s gets explicit_spec(s).
    """

    num_experts: int
    dp_axes: tuple
    fsdp_axes: tuple
    ep_axes: tuple
    tp_axes: tuple
    dp_size: int
    fsdp_size: int
    ep_size: int
    tp_size: int
    fsdp_dim: str
    explicit_axes: tuple = ()  # the mesh's Explicit axes (any role or none), in mesh order

    @property
    def token_axes(self) -> tuple:
        return self.dp_axes + self.fsdp_axes + self.ep_axes

    @property
    def num_token_shards(self) -> int:
        return self.dp_size * self.fsdp_size * self.ep_size

    @property
    def num_ep_groups(self) -> int:
        return self.dp_size * self.fsdp_size

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def token_spec(self) -> P:
        return P(_entry(self.token_axes))

    @property
    def expert_dim_axes(self) -> tuple:
        """Mesh axes on the expert dimension of the expert weights, ep first."""
        return self.ep_axes + (self.fsdp_axes if self.fsdp_dim == "expert" else ())

    @property
    def expert_spec(self) -> P:
        return P(_entry(self.expert_dim_axes))

    @property
    def weight_specs(self) -> dict[str, P]:
        """PartitionSpec of every parameter (see moe_praxis.moe.param_shapes)."""
        e = _entry(self.expert_dim_axes)
        tp = _entry(self.tp_axes)
        f = _entry(self.fsdp_axes)
        m = f if self.fsdp_dim == "model" else None
        return {
            "router": P(None, None),
            "wi_gate": P(e, m, tp),
            "wi_up": P(e, m, tp),
            "wi_gate_up": P(e, m, tp),  # interleaved pairs: a tp shard holds whole units
            "wo": P(e, tp, m),
            "expert_bias": P(None),
            # The shared experts are one dense FFN: tp on Hs, fsdp on d_model (whatever
            # fsdp_dim says: they have no expert dimension), replicated over dp and ep.
            "shared_wi_gate": P(f, tp),
            "shared_wi_up": P(f, tp),
            "shared_wo": P(tp, f),
            "shared_gate": P(None, None),  # [M, 1], replicated like the router
        }

    def explicit_spec(self, spec: P) -> P:
        """`spec` restricted to the Explicit mesh axes: the sharding an input's type must carry
        for shard_map's in_specs `spec` (jax.sharding.reshard accepts only Explicit axes)."""
        return restrict_spec(spec, self.explicit_axes)

    def experts_of_rank(self, ep_rank: int) -> list[int]:
        """The experts EP rank `ep_rank` owns: [r * E / ep, (r + 1) * E / ep)."""
        n = self.experts_per_rank
        return list(range(ep_rank * n, (ep_rank + 1) * n))


def psum(x, axes: tuple[str, ...]):
    """x summed over the mesh axes `axes`; x itself with no axes (one body, mesh or none)."""
    return jax.lax.psum(x, axes) if axes else x


def all_gather(x, axes: tuple[str, ...]):
    """x [N, ...] all-gathered over `axes` along dim 0 ([n * N, ...]); x with no axes."""
    return jax.lax.all_gather(x, axes, axis=0, tiled=True) if axes else x


def _axis_sizes(mesh, axes: tuple[str, ...], role: str) -> int:
    if not axes:
        return 1
    shape = dict(mesh.shape)
    for a in axes:
        if a not in shape:
            raise ValueError(f"MeshResources.{role} names mesh axis {a!r}, which the mesh does "
                             f"not have; the mesh axes are {tuple(shape)}")
    return int(math.prod(shape[a] for a in axes))


def restrict_spec(spec: P, axes) -> P:
    """`spec` with only the mesh axes in `axes` left in its entries (the others replicated)."""
    names = lambda e: (e, ) if isinstance(e, str) else tuple(e or ())
    return P(*(_entry(tuple(a for a in names(e) if a in set(axes))) for e in spec))


def gathered_experts(mesh, order: tuple[str, ...], ep_axes: tuple[str, ...],
                     fsdp_axes: tuple[str, ...], num_experts: int, ep_rank: int) -> list[int]:
    """The experts an EP rank holds after gathering over fsdp, when the expert dimension is
    sharded over the mesh axes `order` (row-major, like a PartitionSpec entry)."""
    shape = dict(mesh.shape)
    sizes = [shape[a] for a in order]
    nblocks = int(math.prod(sizes))
    per_block = num_experts // nblocks
    ep_sizes = [shape[a] for a in ep_axes]
    ep_coord = dict(zip(ep_axes, np.unravel_index(ep_rank, ep_sizes) if ep_axes else ()))
    experts = []
    for block in range(nblocks):
        coord = dict(zip(order, np.unravel_index(block, sizes)))
        if all(coord[a] == ep_coord[a] for a in ep_axes):
            experts.extend(range(block * per_block, (block + 1) * per_block))
    return sorted(experts)


def ep_bootstrap(mesh,
                 resources: Optional[MeshResources],
                 num_experts: int,
                 *,
                 d_model: int = None,
                 d_ff: int = None,
                 shared_d_ff: int = None) -> EPLayout:
    """Validates `resources` against `mesh` and returns the EPLayout.

    mesh: a jax.sharding.Mesh (or AbstractMesh); resources: MeshResources; num_experts: E.
    d_model / d_ff, when given, are checked for divisibility by fsdp (fsdp_dim='model') / tp;
    shared_d_ff (Hs of the shared experts, when any) by tp, and d_model then by fsdp too.
    mesh = resources = None: one device, the layout with no axes (every size 1), under which
    every collective of the block is the identity.
    Raises ValueError naming the axis or number at fault and the fix.

    Memoised on its (hashable) arguments: experiments and the Praxis layer validate at build
    time and moe_block asks again per layer and trace; identical calls return the same
    EPLayout and validate once.
    """
    key = (mesh, resources, num_experts, d_model, d_ff, shared_d_ff or None)
    try:
        hash(key)
    except TypeError:  # e.g. a MeshResources holding a list: validate every time
        return _bootstrap(*key)
    return _bootstrap_memo(*key)


@functools.lru_cache(maxsize=256)
def _bootstrap_memo(mesh, resources, num_experts, d_model, d_ff, shared_d_ff) -> EPLayout:
    return _bootstrap(mesh, resources, num_experts, d_model, d_ff, shared_d_ff)


def _bootstrap(mesh, resources, num_experts, d_model, d_ff, shared_d_ff) -> EPLayout:
    if mesh is None and resources is None:
        resources = MeshResources()
    if not isinstance(resources, MeshResources):
        raise ValueError(f"resources must be a moe_praxis.MeshResources, got {resources!r}")
    if mesh is None and any(resources.axes(r) for r in ROLES):
        raise ValueError(f"resources={resources!r} name mesh axes but mesh is None; pass the "
                         "mesh they name, or mesh=None and resources=None for one device")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")
    axes = {r: resources.axes(r) for r in ROLES}
    sizes = {r: _axis_sizes(mesh, axes[r], r) for r in ROLES}
    types = axis_types(mesh)
    manual = [a for r in ROLES for a in axes[r] if types[a] == "Manual"]
    if manual:
        raise ValueError(f"mesh axes {manual} of {describe_mesh(mesh)} are Manual (moe_block is "
                         "called inside a shard_map over them) but have roles, and moe_block "
                         "runs its own shard_map over its role axes: call moe_block outside "
                         "that shard_map, or leave those axes out of its axis_names")
    ep = sizes["ep"]
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the ep size {ep} (mesh "
                         f"axes {axes['ep']}); use an ep size that divides {num_experts}")
    layout = EPLayout(num_experts=num_experts,
                      dp_axes=axes["dp"],
                      fsdp_axes=axes["fsdp"],
                      ep_axes=axes["ep"],
                      tp_axes=axes["tp"],
                      dp_size=sizes["dp"],
                      fsdp_size=sizes["fsdp"],
                      ep_size=ep,
                      tp_size=sizes["tp"],
                      fsdp_dim=resources.fsdp_dim,
                      explicit_axes=tuple(a for a, t in types.items() if t == "Explicit"))
    if resources.fsdp_dim == "expert" and num_experts % (ep * sizes["fsdp"]):
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep x fsdp = {ep} x {sizes['fsdp']} "
            "(fsdp shards the expert dimension after ep); use MeshResources(fsdp_dim='model') "
            "to shard d_model over fsdp instead, or a smaller fsdp")
    on_model = resources.fsdp_dim == "model" or shared_d_ff
    if d_model is not None and on_model and d_model % sizes["fsdp"]:
        raise ValueError(f"d_model={d_model} is not divisible by the fsdp size {sizes['fsdp']} "
                         f"(mesh axes {axes['fsdp']}), which shards it with fsdp_dim='model' "
                         "and in the shared experts' weights")
    for name, h in (("d_ff", d_ff), ("shared_d_ff", shared_d_ff)):
        if h and h % sizes["tp"]:
            raise ValueError(f"{name}={h} is not divisible by the tp size {sizes['tp']} (mesh "
                             f"axes {axes['tp']}); tp shards the hidden dimension")
    if resources.expert_dim_order is not None:
        _check_expert_dim_order(mesh, layout,
                                _as_tuple("expert_dim_order", resources.expert_dim_order))
    return layout


def _check_expert_dim_order(mesh, layout: EPLayout, order: tuple[str, ...]) -> None:
    want = layout.expert_dim_axes
    if sorted(order) != sorted(want):
        raise ValueError(
            f"expert_dim_order={order!r} must name exactly the ep and fsdp axes sharding the "
            f"expert dimension, {want!r} (fsdp_dim={layout.fsdp_dim!r})")
    if order == want:
        return
    e = layout.num_experts
    for r in range(layout.ep_size):
        got = gathered_experts(mesh, order, layout.ep_axes, layout.fsdp_axes, e, r)
        if got != layout.experts_of_rank(r):
            shape = dict(mesh.shape)
            desc = " x ".join(f"{a}{shape[a]}" for a in order)
            raise ValueError(
                f"expert_dim_order={order!r} puts fsdp before ep on the expert dimension: on "
                f"{desc} with {e} experts, EP rank {r} would gather experts {got} instead of its "
                f"contiguous experts {layout.experts_of_rank(r)}. Shard the expert dimension ep "
                f"first: write {_entry(want)!r} (PartitionSpec entry P({_entry(want)!r}, ...)), "
                "or MeshResources(fsdp_dim='model') to shard d_model over fsdp")
