"""shard_map typing helpers: which manual mesh axes an array varies over, and casts to vary.

Inside ``jax.shard_map(check_vma=True)`` every array carries the set of manual axes it varies
over; custom_vjp rules, FFI calls and collectives must agree on it. Outside shard_map every
helper here is the identity (or returns an empty set).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10+
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """x marked varying over the mesh axes `axes` too (shard_map's type system; a no-op for
    axes it already varies over). Its cotangent may then vary over them, and autodiff of the
    cast sums it back over them."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_together(*xs):
    """Each x cast to vary over the union of the xs' varying axes.

    An FFI call's outputs vary over the union of its inputs' axes, so a custom_vjp around one
    must see inputs of one type to return cotangents of its inputs' types; autodiff of the
    cast sums a cotangent back over the axes its input did not vary over."""
    axes = frozenset().union(*(varying_axes(x) for x in xs))
    return [vary(x, axes) for x in xs]


def zero_cotangent(x):
    """The zero cotangent of x: zeros for float x, float0 zeros for integer x (counts, maps)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
