"""moe_praxis: an expert-parallel Mixture-of-Experts layer for JAX and Praxis.

Importing this package applies the Praxis-on-current-JAX shims (``moe_praxis.praxis.compat``)
so that ``praxis`` can be imported afterwards.
"""

from moe_praxis.praxis import compat  # imports no praxis

compat.apply()

from moe_praxis.config import MoEConfig  # noqa: E402
from moe_praxis.moe import MoEOutput, init_moe_params, moe_block  # noqa: E402

__all__ = ["MoEConfig", "MoEOutput", "init_moe_params", "moe_block"]


def __getattr__(name):
    # Praxis-dependent names are imported lazily so the functional API does not import praxis.
    if name == "MoEFeedForward":
        from moe_praxis.praxis import layer

        return layer.MoEFeedForward
    if name == "convert_gshard_params":
        from moe_praxis.praxis import gshard

        return gshard.convert_gshard_params
    if name in ("MeshResources", "ep_bootstrap", "EPLayout"):
        from moe_praxis import resources

        return getattr(resources, name)
    raise AttributeError(f"module 'moe_praxis' has no attribute {name!r}")
