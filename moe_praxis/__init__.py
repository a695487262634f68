"""moe_praxis: an expert-parallel Mixture-of-Experts layer for JAX and Praxis.

Importing this package applies the Praxis-on-current-JAX shims (``moe_praxis.praxis.compat``)
so that ``praxis`` can be imported afterwards.
"""

from moe_praxis.praxis import compat  # imports no praxis

compat.apply()

from moe_praxis.balancing import update_expert_bias  # noqa: E402
from moe_praxis.config import MoEConfig  # noqa: E402
from moe_praxis.experts import quantize_expert_weights  # noqa: E402
from moe_praxis.moe import MoEOutput, init_moe_params, moe_block  # noqa: E402
from moe_praxis.params import trainable_mask  # noqa: E402
from moe_praxis.plan import backend_info, describe_plan, resolve_plan  # noqa: E402
from moe_praxis.praxis.fp8_params import step_fp8_weights  # noqa: E402  (imports no praxis)
from moe_praxis.praxis.gshard import convert_gshard_params  # noqa: E402  (imports no praxis)
from moe_praxis.praxis.step_weights import cast_expert_weights  # noqa: E402  (imports no praxis)
from moe_praxis.resources import EPLayout, MeshResources, ep_bootstrap  # noqa: E402

__all__ = [
    "EPLayout", "MeshResources", "MoEConfig", "MoEOutput", "backend_info", "cast_expert_weights",
    "convert_gshard_params", "describe_plan", "ep_bootstrap", "init_moe_params", "moe_block",
    "quantize_expert_weights", "resolve_plan", "step_fp8_weights", "trainable_mask",
    "update_expert_bias"
]


def __getattr__(name):
    # PEP 562: MoEFeedForward imports praxis (heavy), so it loads on first access and the
    # functional API never imports praxis.
    if name == "MoEFeedForward":
        from moe_praxis.praxis import layer

        return layer.MoEFeedForward
    raise AttributeError(f"module 'moe_praxis' has no attribute {name!r}")
