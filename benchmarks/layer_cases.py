"""What `python -m benchmarks.layer` times: the shapes, the methods' step functions, the skewed
router and the ideals. Letters: T tokens, M d_model, H d_ff, E experts, k top_k, R = T * k.

Every step function is jitted and takes its arrays as arguments (nothing is a compile-time
constant), so the skewed variant of a shape reuses the balanced one's executables: the skew is
in the values (a router column and an offset of the router's input, `skew_inputs`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis as mp  # before praxis: applies the Praxis compat shims
from moe_praxis import ops, routing
from moe_praxis.praxis.gshard import GSHARD_PARAM_NAMES
from praxis import base_layer, pax_fiddle
from praxis.layers import activations, transformers


class Shape(NamedTuple):
    t: int
    m: int
    h: int
    e: int
    k: int
    routing: dict  # MoEConfig routing fields beyond softmax top-k


DEEPSEEK_ROUTING = dict(score_func="sigmoid",
                        num_expert_groups=8,
                        group_topk=4,
                        use_expert_bias=True,
                        routed_scaling_factor=2.5)
SHAPES = {
    "mixtral": Shape(16384, 4096, 14336, 8, 2, {}),
    "qwen3": Shape(16384, 2048, 768, 128, 8, {}),
    "deepseek": Shape(8192, 7168, 2048, 256, 8, DEEPSEEK_ROUTING),
    # one EP-4 rank's experts of the DeepSeek-V3-like layer: about 1024 rows per expert
    "deepseek_ep4": Shape(8192, 7168, 2048, 64, 8, DEEPSEEK_ROUTING),
}
QUICK_SHAPES = {  # the same routing at CPU sizes (--quick)
    "mixtral": Shape(256, 64, 128, 8, 2, {}),
    "qwen3": Shape(256, 64, 32, 16, 4, {}),
    "deepseek": Shape(128, 64, 32, 32, 8, DEEPSEEK_ROUTING),
    "deepseek_ep4": Shape(128, 64, 32, 16, 8, DEEPSEEK_ROUTING),
}
# method -> (MoEConfig fields, runs MoEFeedForward instead of moe_block). 'cuda' methods run
# with kernel_backend 'xla' where CUDA is unusable (--quick on the CPU), said in the output.
BLOCK_METHODS = {
    "cuda": (dict(kernel_backend="cuda"), False),
    "cuda+fuse": (dict(kernel_backend="cuda", fuse_gate_up=True), False),
    "cuda+gather": (dict(kernel_backend="cuda", gather_combine=True), False),
    # dSwiGLU in the down projection's dgrad epilogue (ops.swiglu_down), without / with the
    # fused gate/up in front
    "cuda+dswiglu": (dict(kernel_backend="cuda", fuse_swiglu_bwd=True), False),
    "cuda+fuse+dswiglu": (dict(kernel_backend="cuda", fuse_gate_up=True,
                               fuse_swiglu_bwd=True), False),
    "cuda+regather": (dict(kernel_backend="cuda", regather_rows=True), False),
    "cuda+fuse+regather": (dict(kernel_backend="cuda", fuse_gate_up=True,
                                regather_rows=True), False),
    "cuda+dswiglu+regather": (dict(kernel_backend="cuda", fuse_swiglu_bwd=True,
                                   regather_rows=True), False),
    "cuda+bf16router": (dict(kernel_backend="cuda", router_precision="bf16"), False),
    "cuda-sm80": (dict(kernel_backend="cuda"), False),
    "cuda+fp8": (dict(kernel_backend="cuda", fp8="blockwise"), False),
    "cuda+fp8all": (dict(kernel_backend="cuda", fp8="blockwise", fp8_gemms="all"), False),
    # every expert GEMM in FP8 but the down projection's forward (issue 52's quality runs)
    "cuda+fp8-wo-fwd-bf16": (dict(kernel_backend="cuda",
                                  fp8="blockwise",
                                  fp8_gemms="wi=all,wo=dgrad+wgrad"), False),
    "xla": (dict(kernel_backend="xla"), False),
    "layer": (dict(kernel_backend="cuda"), True),
    "layer+fuse": (dict(kernel_backend="cuda", fuse_gate_up=True), True),
}
# 'cuda+fp8w', 'fp8-quant': FP8 with the weights quantized once per step (layer_fp8w)
METHODS = tuple(BLOCK_METHODS) + ("cuda+fp8w", "fp8-quant", "gshard", "torch", "ideal")
# method -> the grouped GEMM kernel family it forces while its steps are traced
# (ops.backend.force_grouped_gemm): 'cuda-sm80' runs the sm_80 kernels on any GPU from 8.0 (on
# a Hopper GPU too, beside 'cuda' with the Hopper ones, in one process).
GROUPED_GEMM_FAMILY = {"cuda-sm80": "sm80"}
PASSES = ("fwd", "fwd+bwd")
SKEW_RATIO = 4.0  # the busiest expert's copies over the mean, in the skewed variant


def config(shape: Shape, **fields) -> mp.MoEConfig:
    return mp.MoEConfig(d_model=shape.m,
                        d_ff=shape.h,
                        num_experts=shape.e,
                        top_k=shape.k,
                        **shape.routing,
                        **fields)


def expert_flops(shape: Shape, pass_: str) -> float:
    """FLOPs of the three expert GEMMs on the R rows (x3 with the backward's dgrad + wgrad)."""
    fwd = 2.0 * shape.t * shape.k * shape.m * shape.h * 3
    return fwd if pass_ == "fwd" else 3 * fwd


def expert_weight_bytes(shape: Shape) -> int:
    """bf16 bytes of wi_gate, wi_up and wo."""
    return 3 * shape.e * shape.m * shape.h * 2


def make_params(shape: Shape, key) -> dict:
    """bf16 expert weights, float32 router (and expert bias): moe_block's tree, unfused."""
    cfg = config(shape)
    p = mp.init_moe_params(key, cfg, jnp.bfloat16)
    p["router"] = p["router"].astype(jnp.float32)
    if "expert_bias" in p:
        p["expert_bias"] = p["expert_bias"].astype(jnp.float32)
    return p


def fused_params(p: dict) -> dict:
    out = {n: v for n, v in p.items() if n not in ("wi_gate", "wi_up")}
    out["wi_gate_up"] = ops.interleave_gate_up(p["wi_gate"], p["wi_up"])
    return out


# ------------------------------------------------------------------------------ skew


def _skew_router(w, e0: int, v):
    """w [M, E] with its component along the unit vector v removed and v put on column e0:
    an offset a * v of the router's input then adds a to expert e0's logit only."""
    w = w - jnp.outer(v, v @ w)
    return w.at[:, e0].add(v)


def skew_inputs(shape: Shape, params: dict, x, key, target: float = SKEW_RATIO):
    """(router [M, E], offset [M], ratio): the router and the input offset (a * v, added to x, or
    the layer norm's bias for MoEFeedForward) that make expert 0 receive `target` x the mean
    load T*k/E (capped at T, every token), found by bisection on a; ratio is the one reached."""
    cfg = config(shape, kernel_backend="xla")
    v = jax.random.normal(key, (shape.m, ), jnp.float32)
    v = v / jnp.linalg.norm(v)
    w = _skew_router(params["router"], 0, v)
    want = min(target, shape.e / shape.k)
    mean = shape.t * shape.k / shape.e

    @jax.jit
    def ratio(a):  # on the input moe_block gets: x + a * v rounded to x's dtype
        xs = (x.astype(jnp.float32) + a * v).astype(x.dtype)
        r = routing.route(xs, w, cfg, params.get("expert_bias"))
        return jnp.sum(r.expert_ids == 0) / mean

    lo, hi = 0.0, 1.0
    while float(ratio(hi)) < want - 1e-3 and hi < 1e4:
        hi *= 2
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if float(ratio(mid)) < want:
            lo = mid
        else:
            hi = mid
    return w, hi * v, float(ratio(hi))


# ------------------------------------------------------------------------------ moe_block


def block_fns(cfg: mp.MoEConfig) -> dict[str, Callable]:
    """pass -> jitted step of moe_block: fwd (params, x) -> MoEOutput; fwd+bwd (params, x, cot)
    -> (loss, (dparams, dx)), loss = sum(y * cot) + aux + z."""

    def fwd(params, x):
        return mp.moe_block(params, x, cfg)

    def loss(params, x, cot):
        out = mp.moe_block(params, x, cfg)
        y = jnp.sum(out.y.astype(jnp.float32) * cot.astype(jnp.float32))
        return y + out.aux_loss + out.z_loss

    return {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))}


# ------------------------------------------------------------------------------ Praxis layers


def _ctx():
    return base_layer.JaxContext.new_context()


def layer_x(shape: Shape, x):
    """[T, M] -> [B, S, M] for the Praxis layers (S = min(T, 2048)). The layers run with
    fprop_dtype bfloat16 (Praxis's default float32 would run the whole layer in float32)."""
    s = min(shape.t, 2048)
    return x.reshape(shape.t // s, s, shape.m)


def _layer_fns(tpl):
    layer = base_layer.instantiate(tpl)
    mutable = [base_layer.AUX_LOSS, base_layer.SUMMARIES]

    def apply(variables, x):
        with _ctx():
            y, upd = layer.apply(variables, x, jnp.zeros(x.shape[:-1], x.dtype), mutable=mutable)
        aux = sum((jnp.sum(a.astype(jnp.float32))
                   for a in jax.tree.leaves(upd.get(base_layer.AUX_LOSS, {}))), jnp.float32(0))
        return y, aux, upd.get(base_layer.SUMMARIES, {})

    def loss(params, variables, x, cot):
        y, aux, _ = apply({**variables, "params": params}, x)
        return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)) + aux

    grad = jax.value_and_grad(loss, argnums=(0, 2))

    def fwd_bwd(variables, x, cot):
        return grad(variables["params"], variables, x, cot)

    return layer, {"fwd": jax.jit(apply), "fwd+bwd": jax.jit(fwd_bwd)}


def _variables(layer, x, big: dict) -> dict:
    """The layer's variables: its own init for everything but the `big` weights (computed
    without them: they are not outputs, so XLA drops their initialisation), then `big`."""

    def small(key):
        with _ctx():
            v = layer.init(key, x, jnp.zeros(x.shape[:-1], x.dtype))
        return jax.tree_util.tree_map_with_path(
            lambda p, a: None if getattr(p[-1], "key", None) in big else a, v)

    v = dict(jax.jit(small)(jax.random.key(0)))
    v["params"] = {**v["params"], **big}
    return v


def layer_template(shape: Shape, *, fuse: bool, backend: str) -> pax_fiddle.Config:
    """MoEFeedForward (layer norm + moe_block + residual), dropless top-k with the shape's own
    routing (score function, expert groups, expert bias, routed scaling: `shape.routing`)."""
    return pax_fiddle.Config(mp.MoEFeedForward,
                             name="moe",
                             input_dims=shape.m,
                             hidden_dims=shape.h,
                             num_experts=shape.e,
                             num_experts_per_token=shape.k,
                             gating_func="topk",
                             num_groups=1,
                             use_gated_activation=True,
                             activation_tpl=pax_fiddle.Config(activations.SiLU),
                             aux_loss_type="switch",
                             moe_load_balance_loss_weight=0.01,
                             fuse_gate_up=fuse,
                             kernel_backend=backend,
                             fprop_dtype=jnp.bfloat16,
                             **shape.routing)


def moe_layer(shape: Shape, params: dict, x3, *, fuse: bool, backend: str):
    """The layer of `layer_template` on `params` -> (fns, variables). Its expert_bias is the
    layer's own NON_TRAINABLE variable (zeros, like make_params')."""
    layer, fns = _layer_fns(layer_template(shape, fuse=fuse, backend=backend))
    big = {n: v for n, v in params.items() if n != "expert_bias"}
    return fns, _variables(layer, x3, big)


def gshard_layer(shape: Shape, params: dict, x3, *, cf: float, groups: int):
    """Praxis's TransformerFeedForwardMoe (GShard top-2, capacity factor `cf` in its per-token
    convention: C = cf * S / E per group of S tokens) on the same weights -> (fns, variables)."""
    tpl = pax_fiddle.Config(transformers.TransformerFeedForwardMoe,
                            name="gshard",
                            input_dims=shape.m,
                            hidden_dims=shape.h,
                            num_experts=shape.e,
                            num_groups=groups,
                            gating_func="top2",
                            unadjusted_expert_capacity_factor=cf,
                            use_gated_activation=True,
                            activation_tpl=pax_fiddle.Config(activations.SiLU),
                            moe_load_balance_loss_weight=0.01,
                            fprop_dtype=jnp.bfloat16)
    layer, fns = _layer_fns(tpl)
    ours_to_gshard = {ours: theirs for theirs, ours in GSHARD_PARAM_NAMES.items()}
    big = {ours_to_gshard[n]: v for n, v in params.items() if n in ours_to_gshard}
    big["gate"] = big["gate"].astype(x3.dtype)
    return fns, _variables(layer, x3, big)


def gshard_dropped(summaries) -> float | None:
    """Share of the token copies GShard top-2 drops, from its dispatch_1 / dispatch_2 summaries
    (fractions of tokens sent to 1 and to 2 experts): 1 - (d1 + 2 d2) / 2."""
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(summaries)[0]
    }
    d = {}
    for name, v in flat.items():
        for n in (1, 2):
            if f"dispatch_{n}" in name:
                d[n] = float(np.asarray(v, np.float64).mean())
    if set(d) != {1, 2}:
        return None
    return 1.0 - (d[1] + 2 * d[2]) / 2


# ------------------------------------------------------------------------------ ideals


def ideal_fns() -> dict[str, Callable]:
    """The dense bf16 GEMMs of the expert shapes on R rows: 3 for fwd (gate, up, down), 9 for
    fwd+bwd (+ dgrad and wgrad of each). Args: (a [R, M], act [R, H], dg [R, H], du [R, H],
    dy [R, M], wg [M, H], wu [M, H], wo [H, M])."""

    def fwd(a, act, dg, du, dy, wg, wu, wo):
        return a @ wg, a @ wu, act @ wo

    def fwd_bwd(a, act, dg, du, dy, wg, wu, wo):
        return fwd(a, act, dg, du, dy, wg, wu,
                   wo) + (dg @ wg.T, du @ wu.T, dy @ wo.T, a.T @ dg, a.T @ du, act.T @ dy)

    return {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(fwd_bwd)}


def ideal_args(shape: Shape, key):
    r = shape.t * shape.k
    dims = [(r, shape.m), (r, shape.h), (r, shape.h), (r, shape.h), (r, shape.m),
            (shape.m, shape.h), (shape.m, shape.h), (shape.h, shape.m)]
    keys = jax.random.split(key, len(dims))
    return tuple((jax.random.normal(kk, d, jnp.float32) / math.sqrt(d[0])).astype(jnp.bfloat16)
                 for kk, d in zip(keys, dims))
