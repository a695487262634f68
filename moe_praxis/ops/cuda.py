"""Loader of the CUDA kernel library and the CUDA side of the primitives.

The ONE table of FFI handlers is `KERNELS` (XLA custom-call target name -> symbol exported by
``libmoe_praxis_kernels.so``). On import, if the library exists, it is opened with ctypes and
every handler in the table is registered with
``jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="CUDA")``.
The build (``python -m moe_praxis.build_kernels``) checks that the library exports every symbol
of this table. To add a kernel: define it with ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` in a
``kernels/*.cu`` file and add one line here.

Library location: ``$MOE_PRAXIS_KERNEL_LIB`` if set, else ``moe_praxis/lib/libmoe_praxis_kernels.so``.

Every CUDA primitive is called through `platform_dependent`: one traced function whose CUDA
branch is the FFI call and whose default branch is the pure-JAX reference, so the same code runs
on the CPU (reference) and on the GPU (kernel) up to the primitive.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Optional

import jax
import numpy as np

from moe_praxis.ops.vma import vary, vary_together, varying_axes, zero_cotangent  # noqa: F401

ENV_LIB = "MOE_PRAXIS_KERNEL_LIB"
LIB_NAME = "libmoe_praxis_kernels.so"
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "lib" / LIB_NAME

# XLA FFI target name -> exported handler symbol. The one table of kernels.
KERNELS: dict[str, str] = {
    "moe_aux_loss_fwd": "MoeAuxLossFwd",
    "moe_aux_loss_bwd": "MoeAuxLossBwd",
    "moe_router_fwd": "MoeRouterFwd",
    "moe_router_bwd": "MoeRouterBwd",
    "moe_swiglu_fwd": "MoeSwigluFwd",
    "moe_swiglu_bwd": "MoeSwigluBwd",
    "moe_swiglu_bwd_interleaved": "MoeSwigluBwdInterleaved",
    "moe_permute": "MoePermute",
    "moe_unpermute": "MoeUnpermute",
    "moe_grouped_gemm_fwd": "MoeGroupedGemmFwd",
    "moe_grouped_gemm_dgrad": "MoeGroupedGemmDgrad",
    "moe_grouped_gemm_wgrad": "MoeGroupedGemmWgrad",
    "moe_grouped_gemm_swiglu_fwd": "MoeGroupedGemmSwigluFwd",
}

# Minimum compute capability (major * 10 + minor) per op family; ops not listed need 8.0.
MIN_COMPUTE_CAPABILITY: dict[str, int] = {
    "grouped_gemm": 90,  # sm_90a CUTLASS kernels (ops/grouped_gemm.py also needs 9.x)
}
DEFAULT_MIN_COMPUTE_CAPABILITY = 80


def library_path() -> Path:
    """$MOE_PRAXIS_KERNEL_LIB if set, else moe_praxis/lib/libmoe_praxis_kernels.so."""
    env = os.environ.get(ENV_LIB)
    return Path(env).expanduser().resolve() if env else DEFAULT_LIB


class _State:
    loaded: bool = False
    reason: str = "not loaded yet"
    path: Optional[Path] = None
    lib: Optional[ctypes.CDLL] = None


_state = _State()


def load_library(path: Optional[os.PathLike] = None, *, force: bool = False) -> tuple[bool, str]:
    """Opens the library and registers every handler in KERNELS for platform CUDA.

    Returns (loaded, reason): reason says where it was loaded from, or why it was not (file
    missing, ctypes failed to open it, a symbol missing). Idempotent unless `force`.
    """
    if _state.loaded and not force and path is None:
        return True, _state.reason
    p = Path(path) if path is not None else library_path()
    _state.path = p
    if not p.is_file():
        how = (f"${ENV_LIB}={os.environ[ENV_LIB]}" if os.environ.get(ENV_LIB) else
               f"the default location (set ${ENV_LIB} to use another)")
        _state.loaded, _state.reason = False, (
            f"the CUDA kernel library is not built: {p} does not exist ({how}); build it with "
            "`python -m moe_praxis.build_kernels`")
        return False, _state.reason
    try:
        lib = ctypes.CDLL(str(p))
    except OSError as e:
        _state.loaded, _state.reason = False, f"cannot open the CUDA kernel library {p}: {e}"
        return False, _state.reason
    missing = [sym for sym in KERNELS.values() if not hasattr(lib, sym)]
    if missing:
        _state.loaded, _state.reason = False, (
            f"the CUDA kernel library {p} lacks the symbols {missing}; rebuild it with "
            "`python -m moe_praxis.build_kernels`")
        return False, _state.reason
    try:
        for name, sym in KERNELS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, sym)), platform="CUDA")
    except Exception as e:  # noqa: BLE001 - registration failures become a reason
        _state.loaded, _state.reason = False, f"registering the FFI targets failed: {e}"
        return False, _state.reason
    _state.lib = lib
    _state.loaded, _state.reason = True, f"loaded from {p}"
    return True, _state.reason


def call_stats() -> dict:
    """Grouped GEMM handler calls so far in this process, and how many of them ran while XLA
    was capturing their stream into a CUDA graph (command buffer); for tests and debugging.
    Raises RuntimeError when the library is not loaded."""
    if _state.lib is None:
        raise RuntimeError(f"the CUDA kernel library is not loaded: {_state.reason}")
    out = {}
    for key, sym in (("calls", "moe_praxis_stream_calls"), ("captured",
                                                            "moe_praxis_captured_calls")):
        fn = getattr(_state.lib, sym)
        fn.restype = ctypes.c_longlong
        out[key] = int(fn())
    return out


def library_status() -> tuple[bool, str]:
    """(loaded, reason) of the last load attempt (loads once if never tried)."""
    if not _state.loaded and _state.path is None:
        load_library()
    return _state.loaded, _state.reason


def min_compute_capability(op: str) -> int:
    family = op.split(".")[0]
    return MIN_COMPUTE_CAPABILITY.get(family, DEFAULT_MIN_COMPUTE_CAPABILITY)


# ------------------------------------------------------------------------- calling helpers


def ffi(name: str, results, *args, **attrs):
    """jax.ffi.ffi_call of target `name` (must be in KERNELS); Python floats become f32
    attributes, ints and bools int64 / bool attributes."""
    if name not in KERNELS:
        raise KeyError(f"FFI target {name!r} is not in moe_praxis.ops.cuda.KERNELS "
                       f"(known: {sorted(KERNELS)})")
    conv = {}
    for k, v in attrs.items():
        if isinstance(v, bool):
            conv[k] = v
        elif isinstance(v, (int, np.integer)):
            conv[k] = np.int64(v)
        elif isinstance(v, (float, np.floating)):
            conv[k] = np.float32(v)
        else:
            conv[k] = v
    return jax.ffi.ffi_call(name, results, vmap_method="sequential")(*args, **conv)


def _match_vma(fn: Callable, vma: frozenset) -> Callable:
    """fn with every output marked varying over the manual axes `vma` (inside shard_map an FFI
    call's outputs carry no varying axes while the reference's do; the branches must agree)."""

    def wrapped(*args):
        return jax.tree.map(lambda o: vary(o, vma), fn(*args))

    return wrapped


def platform_call(cuda_fn: Callable, reference_fn: Callable, *args):
    """One function for CPU and GPU: `cuda_fn(*args)` when lowered for CUDA, else
    `reference_fn(*args)` (the pure-JAX reference, same signature and outputs)."""
    vma = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))
    if vma:
        cuda_fn, reference_fn = _match_vma(cuda_fn, vma), _match_vma(reference_fn, vma)
    return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=reference_fn)


load_library()

# ----------------------------------------------------------------------------- primitives
#
# Each primitive below is a jax.custom_vjp whose forward and backward rules call
# `platform_call(<FFI branch>, <pure-JAX reference>, ...)`. The references are imported lazily
# from the op modules (which import this module).

import functools  # noqa: E402
import warnings  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_warned: set = set()


def warn_fallback(op: str, why: str) -> None:
    """Warns once per (op, reason) that the CUDA kernel is not used and why."""
    if (op, why) not in _warned:
        _warned.add((op, why))
        warnings.warn(f"moe_praxis: {op} runs the XLA reference instead of the CUDA kernel: {why}",
                      stacklevel=3)


def no_weights():
    """The routing-weight operand of the kernels that take optional weights (has_weight=False):
    one float32 element, never read. Not a zero-size array: with the 'ragged' exchange, jax
    0.11.2's GPU compiler segfaulted in its SPMD partitioner on a zero-size placeholder (2
    H200s, 2026-11-30), as it did on a varying-cast one (a psum of the zero-size cotangent)."""
    return jnp.zeros((1, ), jnp.float32)


def _float_ok(*xs) -> bool:
    return all(x.dtype in (jnp.float32, jnp.bfloat16) for x in xs)


# --- aux loss: rank-0 scale and cotangent, custom_partitioning with a Shardy rule -----------


def _aux_fwd_ref(probs, f, scale):
    return scale * jnp.sum(jnp.sum(probs.astype(jnp.float32), axis=0) * f.astype(jnp.float32))


# The forward's workspace: one float32 partial sum per block of its first pass, added in a fixed
# order by its second (kMaxPartials in kernels/aux_loss.cu): the loss is bitwise reproducible.
AUX_PARTIALS = 512


def _aux_fwd_ffi(probs, f, scale):
    loss, _ = ffi("moe_aux_loss_fwd", (jax.ShapeDtypeStruct(
        (), jnp.float32), jax.ShapeDtypeStruct((AUX_PARTIALS, ), jnp.float32)), probs, f, scale)
    return loss


def _aux_bwd_ref(g, probs, f, scale):
    row = g * scale * f.astype(jnp.float32)
    return jnp.broadcast_to(row[None, :], probs.shape).astype(probs.dtype)


def _aux_bwd_ffi(g, probs, f, scale):
    return ffi("moe_aux_loss_bwd", jax.ShapeDtypeStruct(probs.shape, probs.dtype), g, probs, f,
               scale)


def _aux_fwd_local(probs, f, scale):
    return platform_call(_aux_fwd_ffi, _aux_fwd_ref, probs, f, scale)


def _aux_bwd_local(g, probs, f, scale):
    return platform_call(_aux_bwd_ffi, _aux_bwd_ref, g, probs, f, scale)


def _spec_axes(spec) -> tuple:
    axes = []
    for entry in spec:
        if entry is None:
            continue
        axes += list(entry) if isinstance(entry, tuple) else [entry]
    return tuple(axes)


def _probs_spec(sharding, ndim=2):
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None, ) * (ndim - len(spec))


def _aux_fwd_partition(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[0].sharding)
    axes = _spec_axes((t_spec, e_spec))

    def lower(probs, f, scale):
        loss = _aux_fwd_local(probs, f, scale)
        return jax.lax.psum(loss, axes) if axes else loss

    args = (NamedSharding(mesh, P(t_spec,
                                  e_spec)), NamedSharding(mesh,
                                                          P(e_spec)), NamedSharding(mesh, P()))
    return mesh, lower, NamedSharding(mesh, P()), args


def _aux_fwd_infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P())


def _aux_bwd_partition(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[1].sharding)
    probs_sharding = NamedSharding(mesh, P(t_spec, e_spec))
    args = (NamedSharding(mesh,
                          P()), probs_sharding, NamedSharding(mesh,
                                                              P(e_spec)), NamedSharding(mesh, P()))
    return mesh, _aux_bwd_local, probs_sharding, args


def _aux_bwd_infer(mesh, arg_shapes, result_shape):
    t_spec, e_spec = _probs_spec(arg_shapes[1].sharding)
    return NamedSharding(mesh, P(t_spec, e_spec))


# probs [T, E], f [E], scale [] -> loss []: T and E are reduced (psum of the shard losses).
aux_loss_fwd_p = custom_partitioning(_aux_fwd_local)
aux_loss_fwd_p.def_partition(partition=_aux_fwd_partition,
                             infer_sharding_from_operands=_aux_fwd_infer,
                             sharding_rule="t e, e, -> ",
                             reduction_factors=("t", "e"))
# g [] (the rank-0 cotangent, never reshaped), probs [T, E], f [E], scale [] -> dprobs [T, E].
aux_loss_bwd_p = custom_partitioning(_aux_bwd_local)
aux_loss_bwd_p.def_partition(partition=_aux_bwd_partition,
                             infer_sharding_from_operands=_aux_bwd_infer,
                             sharding_rule=", t e, e, -> t e")

# custom_partitioning has no batching rule; under vmap (the per-sequence loss) map sequentially.
_aux_fwd_batched = jax.custom_batching.sequential_vmap(lambda p, f, s: aux_loss_fwd_p(p, f, s))
_aux_bwd_batched = jax.custom_batching.sequential_vmap(
    lambda g, p, f, s: aux_loss_bwd_p(g, p, f, s))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def aux_loss(probs, tokens_per_expert, num_tokens, top_k: int, coeff: float):
    """CUDA aux loss (float32 scalar); same math as moe_praxis.ops.aux_loss.aux_loss_reference.

    probs: [T, E]; tokens_per_expert: [E]; num_tokens: rank-0 count T.
    """
    return _aux_fwd_batched(probs, *_aux_consts(probs, tokens_per_expert, num_tokens, top_k, coeff))


def _aux_consts(probs, tpe, num_tokens, top_k, coeff):
    from moe_praxis.ops.aux_loss import aux_loss_scale

    scale = aux_loss_scale(num_tokens, probs.shape[-1], top_k, coeff)
    # the kernels read int32 or float32 counts as they are (no convert kernel before the call)
    f = tpe if tpe.dtype in (jnp.int32, jnp.float32) else tpe.astype(jnp.float32)
    return f, scale.astype(jnp.float32)


def _aux_loss_vjp_fwd(probs, tpe, num_tokens, top_k, coeff):
    return aux_loss(probs, tpe, num_tokens, top_k, coeff), (probs, tpe, num_tokens)


def _aux_loss_vjp_bwd(top_k, coeff, res, g):
    probs, tpe, num_tokens = res
    if jnp.ndim(g) != 0:
        raise ValueError(f"aux-loss cotangent must be rank 0, got shape {jnp.shape(g)}")
    f, scale = _aux_consts(probs, tpe, num_tokens, top_k, coeff)
    dp = _aux_bwd_batched(g.astype(jnp.float32), probs, f, scale)
    return dp, zero_cotangent(tpe), zero_cotangent(num_tokens)


aux_loss.defvjp(_aux_loss_vjp_fwd, _aux_loss_vjp_bwd)

# --- fused router ---------------------------------------------------------------------------

ROUTER_MAX_EXPERTS, ROUTER_MAX_TOP_K, ROUTER_MAX_GROUPS = 512, 8, 32
_ROUTER_MODES = {("softmax", True): 0, ("softmax", False): 1, ("sigmoid", True): 2}


def router_unsupported(num_experts: int, config) -> str:
    """'' if the fused router kernel handles this config, else why not."""
    if num_experts > ROUTER_MAX_EXPERTS:
        return f"num_experts={num_experts} > {ROUTER_MAX_EXPERTS}"
    if config.top_k > ROUTER_MAX_TOP_K:
        return f"top_k={config.top_k} > {ROUTER_MAX_TOP_K}"
    if config.num_expert_groups > ROUTER_MAX_GROUPS:
        return f"num_expert_groups={config.num_expert_groups} > {ROUTER_MAX_GROUPS}"
    return ""


def _router_attrs(config) -> dict:
    return dict(top_k=config.top_k,
                mode=_ROUTER_MODES[(config.score_func, config.pre_softmax)],
                norm_topk=bool(config.norm_topk),
                num_groups=config.num_expert_groups,
                group_topk=config.group_topk,
                scaling=float(config.routed_scaling_factor))


def _router_ref(config, logits, bias):
    from moe_praxis.routing import route_logits_reference

    r = route_logits_reference(logits, config, bias)
    return r.probs, r.expert_ids, r.weights


def _router_fwd_ffi(config, logits, bias):
    t, e = logits.shape
    k = config.top_k
    out = (jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct(
        (t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32))
    return tuple(ffi("moe_router_fwd", out, logits, bias, **_router_attrs(config)))


def _router_bwd_ref(config, logits, bias, ids, dprobs, dweights):
    del ids  # the reference re-selects (same ids: the selection is deterministic)
    _, vjp = jax.vjp(lambda l: (lambda o: (o[0], o[2]))(_router_ref(config, l, bias)), logits)
    return vjp((dprobs, dweights))[0]


def _router_bwd_ffi(config, logits, bias, ids, dprobs, dweights):
    del bias
    return ffi("moe_router_bwd", jax.ShapeDtypeStruct(logits.shape, jnp.float32), logits, ids,
               dprobs, dweights, **_router_attrs(config))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, ))
def fused_router(config, logits, bias):
    """logits: [T, E] f32, bias: [E] f32 (zeros = none; selection only, no gradient)
    -> (probs [T, E] f32, expert_ids [T, k] int32, weights [T, k] f32), as
    moe_praxis.routing.route_logits_reference computes them."""
    return platform_call(functools.partial(_router_fwd_ffi, config),
                         functools.partial(_router_ref, config), logits, bias)


def _fused_router_fwd(config, logits, bias):
    out = fused_router(config, logits, bias)
    return out, (logits, bias, out[1])


def _fused_router_bwd(config, res, cts):
    logits, bias, ids = res
    dprobs, _, dweights = cts
    dprobs = jnp.zeros(logits.shape, jnp.float32) if dprobs is None else dprobs
    dlogits = platform_call(functools.partial(_router_bwd_ffi, config),
                            functools.partial(_router_bwd_ref, config), logits, bias, ids,
                            dprobs.astype(jnp.float32), dweights.astype(jnp.float32))
    return dlogits, jnp.zeros_like(bias)


fused_router.defvjp(_fused_router_fwd, _fused_router_bwd)

# --- SwiGLU ---------------------------------------------------------------------------------


def _swiglu_ref(gate, up, w, has_weight):
    from moe_praxis.ops.swiglu import swiglu_reference

    return swiglu_reference(gate, up, w if has_weight else None, act="silu")


def _swiglu_fwd_ffi(gate, up, w, has_weight):
    return ffi("moe_swiglu_fwd",
               jax.ShapeDtypeStruct(gate.shape, gate.dtype),
               gate,
               up,
               w,
               has_weight=has_weight)


def _swiglu_bwd_ref(gate, up, w, dout, has_weight):
    _, vjp = jax.vjp(lambda g, u, ww: _swiglu_ref(g, u, ww, has_weight), gate, up, w)
    dg, du, dw = vjp(dout)
    return dg, du, dw


def swiglu_bwd_ffi(gate, up, w, dout, has_weight, interleaved=False):
    """The SwiGLU backward kernel: (dgate, dup, dw), or with interleaved=True (dgate_up [R, 2H],
    column 2j d gate j, 2j + 1 d up j: the fused gate/up layout, ops.gate_up) and dw."""
    r, h = gate.shape
    dw = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    if interleaved:
        return tuple(
            ffi("moe_swiglu_bwd_interleaved", (jax.ShapeDtypeStruct((r, 2 * h), gate.dtype), dw),
                gate,
                up,
                w,
                dout,
                has_weight=has_weight))
    out = (jax.ShapeDtypeStruct(gate.shape, gate.dtype), jax.ShapeDtypeStruct(up.shape,
                                                                              up.dtype), dw)
    return tuple(ffi("moe_swiglu_bwd", out, gate, up, w, dout, has_weight=has_weight))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, ))
def _swiglu(gate, up, w, has_weight):
    return platform_call(functools.partial(_swiglu_fwd_ffi, has_weight=has_weight),
                         functools.partial(_swiglu_ref, has_weight=has_weight), gate, up, w)


def _swiglu_vjp_fwd(gate, up, w, has_weight):
    return _swiglu(gate, up, w, has_weight), (gate, up, w)


def _swiglu_vjp_bwd(has_weight, res, dout):
    gate, up, w = res
    dg, du, dw = platform_call(functools.partial(swiglu_bwd_ffi, has_weight=has_weight),
                               functools.partial(_swiglu_bwd_ref, has_weight=has_weight), gate, up,
                               w, dout)
    return dg, du, dw if has_weight else jnp.zeros_like(w)


_swiglu.defvjp(_swiglu_vjp_fwd, _swiglu_vjp_bwd)


def swiglu_unsupported(gate, act: str) -> str:
    """'' if the SwiGLU kernel handles these inputs, else why not."""
    if act != "silu":
        return f"act={act!r} (the kernel fuses silu only)"
    if gate.ndim != 2:
        return f"gate must be [R, H], got shape {gate.shape}"
    if not _float_ok(gate):
        return f"dtype {gate.dtype} (float32 / bfloat16 only)"
    return ""


def swiglu(gate, up, weights=None):
    """silu(gate) * up (* weights[:, None]); gate, up: [R, H] f32 or bf16 (one dtype);
    weights: optional [R] (gradient returned in its dtype). Output in gate.dtype."""
    up = up.astype(gate.dtype)
    # Inside shard_map the inputs get one type (vary_together): e.g. weights that vary over
    # fewer axes than the rows get their gradient summed over the others. Without weights the
    # kernels get no_weights(), left alone (its cotangent is zeros of its own type).
    if weights is None:
        return _swiglu(*vary_together(gate, up), no_weights(), False)
    # autodiff of the cast returns the weights' gradient in their own dtype
    return _swiglu(*vary_together(gate, up, weights.astype(jnp.float32)), True)


# --- permute / unpermute --------------------------------------------------------------------


def _permute_ref(x, row_map):
    from moe_praxis.ops.permute import permute_reference

    return permute_reference(x, row_map)


def _unpermute_ref(num_tokens, y, row_map):
    from moe_praxis.ops.permute import unpermute_reference

    return unpermute_reference(y, row_map, num_tokens)


def _permute_workspace(num_tokens: int, rows: int):
    """The kernels' int32 workspace: the CSR inverse of row_map (2 * T + 4 + R elements)."""
    return jax.ShapeDtypeStruct((2 * num_tokens + 4 + rows, ), jnp.int32)


def _permute_ffi(x, row_map):
    r = row_map.shape[0]
    out = (jax.ShapeDtypeStruct((r, ) + x.shape[1:], x.dtype), _permute_workspace(x.shape[0], r))
    return ffi("moe_permute", out, x, row_map)[0]


def _unpermute_ffi(num_tokens, y, row_map):
    r = row_map.shape[0]
    out = (jax.ShapeDtypeStruct((num_tokens, ) + y.shape[1:],
                                y.dtype), _permute_workspace(num_tokens, r))
    return ffi("moe_unpermute", out, y, row_map)[0]


def _permute_call(x, row_map):
    return platform_call(_permute_ffi, _permute_ref, x, row_map)


def _unpermute_call(num_tokens, y, row_map):
    return platform_call(functools.partial(_unpermute_ffi, num_tokens),
                         functools.partial(_unpermute_ref, num_tokens), y, row_map)


@jax.custom_vjp
def permute(x, row_map):
    """y[r] = x[row_map[r]] (zeros where row_map[r] is outside [0, T)). x: [T, M] f32/bf16;
    row_map: [R] int32 -> [R, M]. Backward: unpermute."""
    return _permute_call(x, row_map)


def _permute_fwd(x, row_map):
    return _permute_call(x, row_map), (row_map, x.shape[0])


def _permute_bwd(res, dy):
    row_map, t = res
    return _unpermute_call(t, dy, row_map), zero_cotangent(row_map)


permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, ))
def unpermute(y, row_map, num_tokens: int):
    """x[t] = sum_{r: row_map[r] = t} y[r]. y: [R, M] f32/bf16; row_map: [R] int32 -> [T, M].
    Backward: permute."""
    return _unpermute_call(num_tokens, y, row_map)


def _unpermute_fwd(y, row_map, num_tokens):
    return _unpermute_call(num_tokens, y, row_map), row_map


def _unpermute_bwd(num_tokens, row_map, dx):
    return _permute_call(dx, row_map), zero_cotangent(row_map)


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def permute_unsupported(x, row_map) -> str:
    """'' if the permute kernels handle these inputs, else why not."""
    if x.ndim != 2:
        return f"x must be [T, M], got shape {x.shape}"
    if not _float_ok(x):
        return f"dtype {x.dtype} (float32 / bfloat16 only)"
    if row_map.ndim != 1:
        return f"row_map must be [R], got shape {row_map.shape}"
    return ""
