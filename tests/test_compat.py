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


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
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
    code = textwrap.dedent(_MESH_CODE.format(setup=setup))
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
