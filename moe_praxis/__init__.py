"""moe_praxis: an expert-parallel Mixture-of-Experts layer for JAX and Praxis.

Importing this package applies the Praxis-on-current-JAX shims (``moe_praxis.compat``) so
that ``praxis`` can be imported afterwards.
"""

from moe_praxis import compat as _compat

_compat.apply()

from moe_praxis.config import MoEConfig  # noqa: E402
from moe_praxis.moe import MoEOutput, init_moe_params, moe_block  # noqa: E402
from moe_praxis.resources import EPLayout, MeshResources, ep_bootstrap  # noqa: E402

__all__ = [
    "EPLayout", "MeshResources", "MoEConfig", "MoEOutput", "ep_bootstrap", "init_moe_params",
    "moe_block"
]


def __getattr__(name):
    # Praxis-dependent names are imported lazily so the functional API does not import praxis.
    if name in ("MoEFeedForward", "convert_gshard_params"):
        from moe_praxis import praxis_layer

        return getattr(praxis_layer, name)
    raise AttributeError(f"module 'moe_praxis' has no attribute {name!r}")
