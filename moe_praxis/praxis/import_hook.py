"""Makes the import order of praxis and moe_praxis not matter.

Praxis 1.4.0 cannot be imported on current JAX until ``moe_praxis.praxis.compat`` has run
(``from praxis import layers`` fails on ``jax.lib.xla_client``). ``import moe_praxis`` runs it,
but a program that imports praxis first would fail. So the install step (``make install``, or
``python -m moe_praxis.praxis.import_hook`` after a plain pip install) writes a ``.pth`` file
into site-packages: at interpreter start-up it runs this file (read by path: no jax, no
moe_praxis import, nothing else loaded), whose finder waits for the first ``import praxis...``
and imports ``moe_praxis.praxis.compat`` (so the shims apply) just before it.

Standard library only; a stale ``.pth`` (this file moved or deleted) does nothing.
"""

import importlib
import importlib.abc
import os
import sys
import sysconfig

PTH_NAME = "moe_praxis_import_hook.pth"
COMPAT = "moe_praxis.praxis.compat"


class PraxisImportHook(importlib.abc.MetaPathFinder):
    """On the first import of ``praxis`` (or a submodule), imports the compat module first;
    it finds nothing itself. It stays on ``sys.meta_path`` (the import system is iterating that
    list while it runs), inert after the first time."""

    def __init__(self):
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if self.done or fullname.split(".")[0] != "praxis":
            return None
        self.done = True
        try:
            importlib.import_module(COMPAT).apply()
        except ImportError:  # moe_praxis is not importable here: praxis fails as it would
            pass
        return None


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once; not when praxis is already loaded)."""
    if "praxis" in sys.modules or any(isinstance(f, PraxisImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PraxisImportHook())


def pth_line(hook_path: str) -> str:
    """The one line of the ``.pth`` file: runs ``hook_path`` if it still exists, then
    ``install()``."""
    return (f"import os; p = {hook_path!r}; g = {{'__name__': 'moe_praxis_import_hook'}}; "
            "os.path.isfile(p) and (exec(compile(open(p).read(), p, 'exec'), g), "
            "g['install']())\n")


def write_pth(site_dir: str) -> str:
    """Writes the ``.pth`` file into ``site_dir``; returns its path."""
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as f:
        f.write(pth_line(os.path.abspath(__file__)))
    return path


if __name__ == "__main__":
    print(f"wrote {write_pth(sysconfig.get_paths()['purelib'])}")
