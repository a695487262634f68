"""The layer benchmark's FP8 step per optimizer step (`--microbatches`).

A train step with n micro-batches quantizes the expert weights once (moe_praxis.
quantize_expert_weights) and runs n forward+backward passes that read the FP8 form; per
micro-batch that costs

    cuda+fp8 @n  =  ms('cuda+fp8w') + ms('fp8-quant') / n

where the form serves at least ops.fp8.rule.FORM_MIN_ROWS rows per expert in its n calls;
below that fp8_gemms='auto' makes no form and runs the bf16 layer, so the row is ms('cuda').

'cuda+fp8w' is moe_block with the FP8 form given (no weight quantization in the step),
'fp8-quant' the quantization alone; both are timed with the other methods. The derived rows
(method 'cuda+fp8 @n', n from --microbatches, default 1,8) carry 'x_cuda' and the per-step FP8
targets (fwd+bwd, balanced load): at n=1 every shape >= 1.0x 'cuda' and Mixtral-like >= 1.35x;
at n=8 DeepSeek-V3-like >= 1.25x and Qwen3-like >= 1.10x.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import moe_praxis as mp
from moe_praxis.ops.fp8 import rule as fp8_rule

PREQUANTIZED = "cuda+fp8w"  # moe_block reading the FP8 form made beforehand
QUANTIZE = "fp8-quant"  # quantize_expert_weights alone
METHODS = (PREQUANTIZED, QUANTIZE)
DEFAULT_MICROBATCHES = (1, 8)
# (shape, micro-batches) -> the least fwd+bwd speed over 'cuda'; n=1 any shape 1.0
TARGETS = {("mixtral", 1): 1.35, ("deepseek", 8): 1.25, ("qwen3", 8): 1.10}
FP8_WEIGHTS = "fp8_weights"


def fns(cfg: mp.MoEConfig) -> dict[str, Callable]:
    """pass -> jitted step: for PREQUANTIZED fwd (params, fws, x), fwd+bwd (params, fws, x, cot)
    -> (loss, (dparams, dx)) (fws gets no gradient); 'quantize' params -> fws."""

    def block(params, fws, x):
        return mp.moe_block({**params, FP8_WEIGHTS: fws}, x, cfg)

    def loss(params, fws, x, cot):
        out = block(params, fws, x)
        y = jnp.sum(out.y.astype(jnp.float32) * cot.astype(jnp.float32))
        return y + out.aux_loss + out.z_loss

    def quantize(params):
        return mp.quantize_expert_weights(params, cfg)[FP8_WEIGHTS]

    return {
        "fwd": jax.jit(block),
        "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 2))),
        "quantize": jax.jit(quantize)
    }


def amortized(rows: list[dict], microbatches, rows_per_expert=None) -> list[dict]:
    """The derived rows 'cuda+fp8 @n' of one (shape, load, pass) unit's timed rows (empty
    where PREQUANTIZED or QUANTIZE did not run).

    rows_per_expert: one call's rows per expert (T * k / E). Where the FP8 form would serve
    fewer than ops.fp8.rule.FORM_MIN_ROWS rows per expert in n calls, fp8_gemms='auto' makes
    none and runs the bf16 layer (the experiments' train step, moe_block): the row is then
    'cuda''s time, with 'fp8_form': False. None: the form is always made."""
    by = {r["method"]: r.get("ms") for r in rows}
    pre, quant, cuda = by.get(PREQUANTIZED), by.get(QUANTIZE), by.get("cuda")
    if pre is None or quant is None:
        return []
    base = {k: rows[0][k] for k in ("shape", "load", "pass_")}
    out = []
    for n in microbatches:
        form = rows_per_expert is None or fp8_rule.form_pays("auto", rows_per_expert * n)
        if not form and cuda is None:
            continue
        ms = pre + quant / n if form else cuda
        r = dict(base,
                 method=f"cuda+fp8 @{n}",
                 ms=ms,
                 microbatches=n,
                 status="computed",
                 fp8_form=form)
        r["x_cuda"] = cuda / ms if cuda else None
        out.append(r)
    return out


def target(r: dict):
    """(text, ok) of the per-step FP8 target for a derived row, or None where none applies."""
    n = r.get("microbatches")
    if n is None or r["pass_"] != "fwd+bwd" or r["load"] != "balanced":
        return None
    least = TARGETS.get((r["shape"], n), 1.0 if n == 1 else None)
    if least is None:
        return None
    xc = r.get("x_cuda") or 0
    return f">= {least}x 'cuda' (x{xc:.2f})", xc >= least
