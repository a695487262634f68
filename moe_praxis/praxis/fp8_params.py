"""The FP8 form of a model's expert weights, made once per optimizer step.

A train step asks `step_fp8_weights(params, layer, mesh, tokens_per_step, dtype)` (the one entry,
`moe_praxis.step_fp8_weights`) once, outside its forward and backward (and outside any loop over
micro-batches), and passes its `merged(params)` to the model's apply:
every MoEFeedForward with fp8 set finds its weights' FP8 form as the undeclared params entry
'fp8_weights' and quantizes no weight itself. Gradients are taken w.r.t. `params` alone; they
reach the master weights as when each layer quantizes inside (bitwise the same step).

An MoE layer's params are recognised by their keys (a 'router' and a 'wo' beside it, the
moe.param_shapes contract); stacked layers (Praxis Repeat: a leading layer dimension) are
quantized layer by layer. `dtype` is the layers' fprop_dtype: Praxis casts the weights to it
before the layer sees them, so the form is made from the same values.
"""

from __future__ import annotations

import dataclasses

import jax

from moe_praxis import expert_weights
from moe_praxis.experts import EXPERT_WEIGHTS, FP8_WEIGHTS
from moe_praxis.ops.fp8 import recipe, rule
from moe_praxis.ops.fp8 import weights as fp8_weights
from moe_praxis.praxis.step_weights import is_moe_params
from moe_praxis.resources import ep_bootstrap


def _quantize(w, dtype, transposed: bool):
    fn = lambda a: fp8_weights.quantize(a.astype(dtype), transposed=transposed)
    for _ in range(w.ndim - 3):  # stacked layers: one quantization per layer
        fn = jax.vmap(fn)
    return fn(w)


def fp8_weights_tree(params, dtype, *, transposed: bool = False) -> dict:
    """{path...: {'fp8_weights': {name: Fp8Weight}}} for every MoE layer's params in `params`
    (nested dicts), the expert weights cast to `dtype` and quantized once; transposed: also qt
    (the CUDA forward reads it)."""
    out = {}
    for key, node in params.items():
        if is_moe_params(node):
            out[key] = {
                FP8_WEIGHTS: {
                    n: _quantize(node[n], dtype, transposed)
                    for n in EXPERT_WEIGHTS if n in node
                }
            }
        elif isinstance(node, dict):
            sub = fp8_weights_tree(node, dtype, transposed=transposed)
            if sub:
                out[key] = sub
    return out


def merge(params, tree) -> dict:
    """params with the entries of `tree` (fp8_weights_tree) added beside the weights."""
    out = dict(params)
    for key, sub in tree.items():
        out[key] = sub if key == FP8_WEIGHTS else merge(params[key], sub)
    return out


def form_pays(layer, mesh, tokens_per_step: int) -> bool:
    """Whether the FP8 form of an MoE layer's expert weights (`layer`: its MoEFeedForward
    config), made once per optimizer step, serves enough rows per local expert to pay
    (ops.fp8.rule.form_pays under the layer's fp8_gemms): the step's tokens over the token
    shards, times top-k, over the experts of one EP rank. Where it does not, no form is made
    and each call runs the bf16 layer (its own rows are fewer still:
    moe_praxis.expert_weights.fp8_for_call)."""
    resources = layer.mesh_resources
    layout = ep_bootstrap(mesh if resources is not None else None, resources, layer.num_experts)
    rows = expert_weights.rows_per_local_expert(tokens_per_step, layout,
                                                layer.num_experts_per_token)
    return rule.form_pays(layer.fp8_gemms, rows)


def transposed_for(kernel_backend: str) -> bool:
    """Whether the form needs W^T too: where kernel_backend resolves to the FP8 kernels (their
    forward reads it)."""
    return recipe.resolve(kernel_backend) == "cuda"


@dataclasses.dataclass(frozen=True)
class StepFp8Weights:
    """The FP8 form of a model's MoE expert weights for one optimizer step (step_fp8_weights).

    pays: whether the form is made (form_pays at the step's tokens); where it is not, every
      layer runs as bf16 and ``merged`` returns the params as they are.
    tree: the form (fp8_weights_tree), None where it does not pay.
    """

    pays: bool
    tree: dict | None = None

    def merged(self, params) -> dict:
        """``params`` with the form beside each MoE layer's weights, to pass to the model's
        apply inside the loss (gradients are taken w.r.t. ``params`` alone)."""
        return merge(params, self.tree) if self.tree else params


def step_fp8_weights(params, layer, mesh, tokens_per_step: int, dtype) -> StepFp8Weights:
    """What a train step asks the layer once per optimizer step, outside its forward, backward
    and micro-batch loop: whether the FP8 form of the expert weights pays at ``tokens_per_step``
    (form_pays; `layer`: an MoEFeedForward config with fp8 set, its ``kernel_backend`` deciding
    whether W^T is made too) and, where it does, the form of every MoE layer's weights in
    ``params`` cast to ``dtype`` (the layers' fprop_dtype) and quantized once."""
    if not form_pays(layer, mesh, tokens_per_step):
        return StepFp8Weights(pays=False)
    transposed = transposed_for(layer.kernel_backend)
    return StepFp8Weights(pays=True, tree=fp8_weights_tree(params, dtype, transposed=transposed))
