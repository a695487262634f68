"""Praxis 1.4.0 on current JAX (0.10 / 0.11): the three things that break, and nothing else.

Praxis 1.4.0 is the last release and pins jax 0.4.26 and TensorFlow 2.9. We install it with
``pip install --no-deps`` and apply these shims before ``praxis`` is imported (``import
moe_praxis`` does it; so does ``moe_praxis.praxis.compat.apply()`` called by hand). This module
does not import praxis itself: it patches ``praxis.py_utils`` when that is first imported.

1. ``jax.lib.xla_client`` is gone. ``praxis.base_input`` does ``from jax.lib import
   xla_client`` at import time (so ``import praxis.layers`` fails); we re-expose jaxlib's
   module under the old name.
2. The top-level tree aliases (``jax.tree_map``, ``jax.tree_leaves``, ``jax.tree_flatten``,
   ...) are gone. Praxis's ``Repeat``, ``StackedTransformerRepeated``, ``flax_utils`` and its
   optimizers call them; we alias them to ``jax.tree_util``.
3. ``praxis.py_utils.global_mesh_defined()`` only looks at the legacy ``with mesh:`` resource
   env, so under ``jax.set_mesh(mesh)`` it returns False and every activation sharding
   constraint Praxis (and our layer) declares is silently dropped. We make it also see the
   mesh set with ``jax.set_mesh``.

Each shim is tested by a test that fails without it (tests/test_compat.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import jax
import jax.lib

try:  # private modules: the shims degrade to no-ops if a future JAX removes them
    from jax._src import mesh as _mesh_lib
except ImportError:  # pragma: no cover
    _mesh_lib = None
try:
    from jax._src.lib import xla_client as _xla_client  # the module jaxlib still ships
except ImportError:  # pragma: no cover
    _xla_client = None

# Top-level names Praxis / lingvo / clu call that moved to jax.tree_util.
TREE_ALIASES = {
    "tree_map": "tree_map",
    "tree_leaves": "tree_leaves",
    "tree_flatten": "tree_flatten",
    "tree_unflatten": "tree_unflatten",
    "tree_structure": "tree_structure",
    "tree_transpose": "tree_transpose",
    "tree_reduce": "tree_reduce",
    "tree_multimap": "tree_map",
}

_applied = False


def _shim_xla_client() -> bool:
    if hasattr(jax.lib, "xla_client") or _xla_client is None:
        return False
    jax.lib.xla_client = _xla_client
    sys.modules.setdefault("jax.lib.xla_client", _xla_client)
    return True


def _legacy_mesh():
    """The mesh of a legacy ``with mesh:`` block, or None."""
    try:
        pm = _mesh_lib.thread_resources.env.physical_mesh
    except AttributeError:  # pragma: no cover - removed in a future JAX (or _mesh_lib None)
        return None
    return None if pm.empty else pm


def _shim_tree_aliases() -> list[str]:
    added = []
    for old, new in TREE_ALIASES.items():
        if not hasattr(jax, old):
            setattr(jax, old, getattr(jax.tree_util, new))
            added.append(old)
    return added


def mesh_defined() -> bool:
    """True when a mesh is active, set either by ``jax.set_mesh`` or by legacy ``with mesh:``."""
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    return _legacy_mesh() is not None


def current_mesh():
    """The concrete mesh in scope (``jax.set_mesh`` first, then ``with mesh:``), or None.

    Inside ``jax.jit`` tracing ``jax.sharding.get_mesh()`` refuses to run; there the concrete
    mesh set by ``jax.set_mesh`` is read from JAX's context directly (or, failing that, its
    ``AbstractMesh`` is returned, enough for ``shard_map``)."""
    try:
        m = jax.sharding.get_mesh() if hasattr(jax.sharding, "get_mesh") else None
    except ValueError:  # under jit: "get_mesh can only be used outside of jax.jit"
        get_concrete = getattr(_mesh_lib, "get_concrete_mesh", None)
        m = get_concrete() if get_concrete is not None else None
        if m is None or m.empty:
            m = jax.sharding.get_abstract_mesh()
    if m is not None and not m.empty:
        return m
    return _legacy_mesh()


def _patch_py_utils(py_utils) -> None:
    if getattr(py_utils.global_mesh_defined, "_moe_praxis_shim", False):
        return

    def global_mesh_defined() -> bool:
        return mesh_defined()

    global_mesh_defined._moe_praxis_shim = True
    global_mesh_defined.__doc__ = "moe_praxis.praxis.compat: " + mesh_defined.__doc__
    py_utils.global_mesh_defined = global_mesh_defined


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``praxis.py_utils`` right after it is first imported (no import cost before)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "praxis.py_utils":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_py_utils(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _shim_praxis_mesh() -> None:
    if "praxis.py_utils" in sys.modules:
        _patch_py_utils(sys.modules["praxis.py_utils"])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def apply() -> None:
    """Applies every shim. Idempotent; safe to call before or after importing praxis."""
    global _applied
    if _applied:
        return
    _shim_xla_client()
    _shim_tree_aliases()
    _shim_praxis_mesh()
    _applied = True
