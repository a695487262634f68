"""The execution plan of one moe_block call, resolved once, before anything is traced.

`resolve_plan(config, x, params, mesh=, resources=)` makes every choice that depends on the
device, the shapes, the dtypes or the mesh: the kernel backend, the exchange under expert
parallelism, whether the call runs its expert GEMMs in FP8 (expert_weights.fp8_for_call), and
the three registry entries the block body calls (moe_praxis.variants):

  dispatcher  how the sorted rows reach the experts (dispatch.dispatchers.DISPATCHERS)
  experts     the expert implementation (experts.EXPERTS)
  combiner    how their outputs return to the tokens (dispatch.combiners.COMBINERS)

each with the reason it was chosen. Every support check and fallback warning happens here
(use_cudnn_fusion, the FP8 emulation, a kernel family that does not run here, ...);
the block body reads only the plan. `describe_plan(config, x)` prints it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax

from moe_praxis import expert_weights
from moe_praxis.config import MoEConfig
from moe_praxis.dispatch import exchange
from moe_praxis.dispatch.combiners import COMBINERS
from moe_praxis.dispatch.dispatchers import DISPATCHERS
from moe_praxis.experts import EXPERTS, FP8_WEIGHTS, WI, check_cudnn_fusion
from moe_praxis.ops import backend_info as ops_backend_info
from moe_praxis.ops import resolve_backend
from moe_praxis.params import param_shapes
from moe_praxis.resources import EPLayout, ep_bootstrap
from moe_praxis.variants import Choice, Query, pick

__all__ = ["Plan", "backend_info", "describe_plan", "layout_widths", "resolve_plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one moe_block call runs; the block body reads nothing else to choose."""
    backend: str  # the resolved kernel backend, 'xla' | 'cuda'
    config: MoEConfig  # the config the call runs (fp8=None where its FP8 form would not pay)
    exchange: str  # 'none' (ep size 1) | 'padded' | 'ragged' (dispatch.exchange)
    dispatcher: Choice
    experts: Choice
    combiner: Choice
    # ((expert weight, ops.fp8.rule.Fp8Gemms), ...) of the GEMMs the call runs in FP8
    fp8_gemms: tuple = ()

    def describe(self) -> str:
        """The plan in a few lines, each choice with its reason."""
        lines = [f"backend: {self.backend}", f"exchange: {self.exchange}"]
        for role in ("dispatcher", "experts", "combiner"):
            choice = getattr(self, role)
            lines.append(f"{role}: {choice.name} ({choice.reason})")
        if self.fp8_gemms:
            lines.append("fp8 GEMMs: " + ", ".join(f"{n}={g}" for n, g in self.fp8_gemms))
        return "\n".join(lines)


def _local_weights(params, config: MoEConfig, layout: EPLayout, dtype) -> dict:
    """{name: ShapeDtypeStruct} of one EP rank's expert weights after the fsdp gather, in the
    rows' dtype: [E / ep, M, H / tp] for wi_*, [E / ep, H / tp, M] for wo."""
    shapes = {n: tuple(params[n].shape) for n in params if n in WI + ("wo", )} \
        if params is not None else {n: s for n, s in param_shapes(config).items()
                                    if n in WI + ("wo", )}
    out = {}
    for name, (e, a, b) in shapes.items():
        if name == "wo":
            a //= layout.tp_size
        else:
            b //= layout.tp_size
        out[name] = jax.ShapeDtypeStruct((e // layout.ep_size, a, b), dtype)
    return out


def _fp8_gather(params, config: MoEConfig, layout: EPLayout) -> bool:
    """Whether expert_weights.gather_expert_weights leaves the FP8 GEMMs to gather a weight
    (experts.FP8_GATHER): fsdp axes, every GEMM in FP8, quantize-before-gather or a given form."""
    if not layout.fsdp_axes or config.fp8 is None:
        return False
    if not all(c.all for c in config.fp8_choices().values()):
        return False
    given = (params or {}).get(FP8_WEIGHTS, {})
    names = params if params is not None else param_shapes(config)
    return any(n in names and (config.fp8_quantize_before_gather or n in given)
               for n in expert_weights.GATHERED)


def layout_widths(config: MoEConfig) -> dict:
    """The widths ep_bootstrap checks the mesh's roles against (d_model, d_ff, shared_d_ff)."""
    return dict(d_model=config.d_model, d_ff=config.d_ff, shared_d_ff=config.shared_hidden)


def resolve_plan(config: MoEConfig,
                 x,
                 params: Optional[dict] = None,
                 *,
                 mesh=None,
                 resources=None,
                 backend: Optional[str] = None,
                 layout: Optional[EPLayout] = None,
                 exchange_kind: Optional[str] = None) -> Plan:
    """The plan of moe_block(params, x, config, mesh=, resources=) (module doc).

    x: [..., M] (an array or a jax.ShapeDtypeStruct: only its shape and dtype are read);
    params: the parameter tree (arrays or ShapeDtypeStructs; None: init_moe_params' shapes, no
    FP8 form); mesh / resources: as moe_block's. backend, layout, exchange_kind: already
    resolved by the caller (None: resolved here: resolve_backend, ep_bootstrap,
    exchange.checked_exchange_kind).
    """
    if backend is None:
        backend = resolve_backend(config.kernel_backend, "moe_block")
    if layout is None:
        layout = ep_bootstrap(mesh, resources, config.num_experts, **layout_widths(config))
    if exchange_kind is None and mesh is not None:
        exchange_kind = exchange.checked_exchange_kind(config, mesh, layout.ep_size)
    t = math.prod(x.shape[:-1])
    config, fp8_gemms = expert_weights.fp8_for_call(
        config, params or {}, expert_weights.rows_per_local_expert(t, layout, config.top_k))
    check_cudnn_fusion(config, backend)
    query = Query(config=config,
                  backend=backend,
                  ep_size=layout.ep_size,
                  tp=bool(layout.tp_axes),
                  x=jax.ShapeDtypeStruct((t // layout.num_token_shards, config.d_model), x.dtype),
                  weights=_local_weights(params, config, layout, x.dtype),
                  fp8_gather=_fp8_gather(params, config, layout),
                  fp8_given=FP8_WEIGHTS in (params or {}))
    dispatcher = pick(DISPATCHERS, query, "dispatcher")
    if layout.ep_size > 1 and dispatcher.entry.regrouped is None:  # each choose checks ep_size
        raise RuntimeError(f"dispatcher {dispatcher.name!r} applied under expert parallelism "
                           "but has no form for the exchanged rows (Entry.regrouped)")
    return Plan(backend=backend,
                config=config,
                exchange="none" if layout.ep_size == 1 else exchange_kind,
                dispatcher=dispatcher,
                experts=pick(EXPERTS, query, "expert implementation"),
                combiner=pick(COMBINERS, query, "combiner"),
                fp8_gemms=tuple(fp8_gemms.items()))


def describe_plan(config: MoEConfig,
                  x,
                  params: Optional[dict] = None,
                  *,
                  mesh=None,
                  resources=None) -> str:
    """resolve_plan(...).describe(): what moe_block would run on x (shape and dtype) and why."""
    return resolve_plan(config, x, params, mesh=mesh, resources=resources).describe()


def backend_info(config: Optional[MoEConfig] = None,
                 x=None,
                 params: Optional[dict] = None,
                 *,
                 mesh=None,
                 resources=None) -> dict:
    """moe_praxis.ops.backend_info(config) (the device, each op's kernel and why, the FP8 rule)
    and, with a config and x, 'plan': what moe_block would run on x (resolve_plan(...).describe(),
    the text describe_plan prints)."""
    info = ops_backend_info(config)
    if config is not None and x is not None:
        info["plan"] = resolve_plan(config, x, params, mesh=mesh, resources=resources).describe()
    return info
