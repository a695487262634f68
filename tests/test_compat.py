"""Each Praxis-on-current-JAX shim, with a check that FAILS without it (in a fresh process that
does not import moe_praxis) and passes with it."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_praxis  # noqa: F401  (applies the shims)
from moe_praxis.praxis import compat

# Where `make install` wrote moe_praxis_import_hook.pth, every fresh process applies the shims
# before its first praxis import; the checks that praxis FAILS without them take it out first.
NO_HOOK = ("import sys; sys.meta_path[:] = "
           "[f for f in sys.meta_path if type(f).__name__ != 'PraxisImportHook']\n")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_HOOK + textwrap.dedent(code)],
                          capture_output=True,
                          text=True,
                          timeout=300)


def test_without_shims_praxis_layers_fails_to_import():
    r = _run("import praxis.layers")
    assert r.returncode != 0 and "xla_client" in r.stderr, r.stderr[-2000:]


def test_xla_client_shim():
    import jax.lib

    assert jax.lib.xla_client.OpSharding  # what praxis.base_input uses
    import praxis.layers  # noqa: F401  (imports praxis.base_input)


def test_without_shims_tree_aliases_are_missing():
    r = _run("""
        import jax
        from praxis import py_utils
        t = py_utils.NestedMap(a=1, b=2)
        py_utils.update_matched_variables(t, t, ['a'])
    """)
    assert r.returncode != 0 and "tree_flatten" in r.stderr, r.stderr[-2000:]


def test_tree_alias_shim_runs_praxis_code():
    from praxis import py_utils

    old = py_utils.NestedMap(a=jnp.zeros(2), b=jnp.zeros(3))
    new = py_utils.NestedMap(a=jnp.ones(2), b=jnp.ones(3))
    out = py_utils.update_matched_variables(old, new, ["a"])  # calls jax.tree_flatten
    np.testing.assert_array_equal(out.a, 1.0)
    np.testing.assert_array_equal(out.b, 0.0)
    for name in compat.TREE_ALIASES:
        assert callable(getattr(jax, name))


_MESH_CODE = """
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    {setup}
    from praxis import py_utils
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        print("DEFINED", py_utils.global_mesh_defined())
        f = jax.jit(lambda x: py_utils.with_sharding_constraint(x * 2, P("a", "b")))
        print("HLO_HAS_SHARDING", "sharding_constraint" in f.lower(jnp.ones((4, 4))).as_text())
"""


def _mesh_env():
    import os

    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return env


@pytest.mark.parametrize("shim", [False, True])
def test_global_mesh_defined_sees_set_mesh(shim):
    setup = "import moe_praxis" if shim else ""
    code = NO_HOOK + textwrap.dedent(_MESH_CODE.format(setup=setup))
    r = subprocess.run([sys.executable, "-c", code],
                       capture_output=True,
                       text=True,
                       timeout=300,
                       env=_mesh_env())
    assert r.returncode == 0, r.stderr[-2000:]
    # Without the shim Praxis silently drops the constraint; with it the HLO keeps it.
    assert f"DEFINED {shim}" in r.stdout, r.stdout
    assert f"HLO_HAS_SHARDING {shim}" in r.stdout, r.stdout


def test_mesh_helpers_in_process():
    assert not compat.mesh_defined() and compat.current_mesh() is None
    mesh = jax.make_mesh((2, 2), ("x", "y"),
                         devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto, ) * 2)
    with jax.set_mesh(mesh):
        assert compat.mesh_defined()
        assert compat.current_mesh().shape == mesh.shape
        from praxis import py_utils

        f = jax.jit(lambda v: py_utils.with_sharding_constraint(v + 1, P("x", None)))
        assert "sharding_constraint" in f.lower(jnp.ones((4, 2))).as_text()


def test_apply_is_idempotent():
    from praxis import py_utils

    fn = py_utils.global_mesh_defined
    compat._applied = False
    compat.apply()
    assert py_utils.global_mesh_defined is fn


def test_import_moe_praxis_applies_the_shims_without_importing_praxis():
    """`import moe_praxis` applies the shims from moe_praxis.praxis.compat but imports no
    praxis module; so does the GShard converter; MoEFeedForward imports praxis on access."""
    r = _run("""
        import sys
        import moe_praxis
        praxis_mods = lambda: sorted(m for m in sys.modules if m.split(".")[0] == "praxis")
        import jax
        print("SHIMMED", hasattr(jax.lib, "xla_client"), hasattr(jax, "tree_map"))
        print("AFTER_IMPORT", praxis_mods())
        moe_praxis.convert_gshard_params({})
        print("AFTER_CONVERTER", praxis_mods())
        moe_praxis.MoEFeedForward
        print("AFTER_LAYER", "praxis.base_layer" in praxis_mods())
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SHIMMED True True" in r.stdout, r.stdout
    assert "AFTER_IMPORT []" in r.stdout and "AFTER_CONVERTER []" in r.stdout, r.stdout
    assert "AFTER_LAYER True" in r.stdout, r.stdout


def _fresh(code: str, site_dir) -> subprocess.CompletedProcess:
    """A fresh interpreter that processes ``site_dir``'s .pth files as it does site-packages'
    at start-up (site.addsitedir), then runs ``code``."""
    head = f"import site, sys\nsite.addsitedir({str(site_dir)!r})\n"
    return subprocess.run([sys.executable, "-c", NO_HOOK + head + textwrap.dedent(code)],
                          capture_output=True,
                          text=True,
                          timeout=300)


def test_with_the_install_hook_praxis_imports_before_moe_praxis(tmp_path):
    """The .pth that `make install` writes makes the import order not matter: praxis first
    (layers, and py_utils with the set_mesh shim), moe_praxis after; start-up itself imports
    neither jax nor moe_praxis."""
    from moe_praxis.praxis import import_hook

    import_hook.write_pth(str(tmp_path))
    r = _fresh(
        """
        print("AT_START", sorted(m for m in ("jax", "moe_praxis", "praxis") if m in sys.modules))
        from praxis import layers, py_utils
        import moe_praxis
        print("LAYERS", hasattr(layers, "StackedTransformer"), moe_praxis.MoEFeedForward.__name__)
        print("MESH_SHIM", getattr(py_utils.global_mesh_defined, "_moe_praxis_shim", False))
    """, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "AT_START []" in r.stdout, r.stdout
    assert "LAYERS True MoEFeedForward" in r.stdout, r.stdout
    assert "MESH_SHIM True" in r.stdout, r.stdout


def test_a_stale_install_hook_does_nothing(tmp_path):
    """A .pth left behind by a moved or deleted checkout neither fails start-up nor warns."""
    from moe_praxis.praxis import import_hook

    (tmp_path / import_hook.PTH_NAME).write_text(import_hook.pth_line(str(tmp_path / "gone.py")))
    r = _fresh("print('STARTED')", tmp_path)
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr[-2000:]
    assert r.stderr == "", r.stderr


def test_make_install_writes_the_import_hook():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "$(PY) -m moe_praxis.praxis.import_hook" in recipe, recipe
