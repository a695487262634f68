"""The layer benchmark's check of the CUDA methods against 'xla' (benchmarks/layer.py's doc),
and how a failed step is named.

An FP8 method is checked on the FP8 GEMMs it is timed with: under fp8_gemms='auto' a call runs
the bf16 layer below ops.fp8.rule.FORM_MIN_ROWS rows per expert, which the check's slice of
CHECK_TOKENS tokens may be while the timed call (the shape's T tokens) is not; there the check
gives the weights' FP8 form (moe_praxis.quantize_expert_weights; a given form is used), so the
slice runs the GEMMs the rule picks for the timed call (`fp8_check_params`).
"""

from __future__ import annotations

import math
import traceback

import jax.numpy as jnp

import moe_praxis as mp
from benchmarks import layer_cases as lc
from moe_praxis import experts, ops
from moe_praxis.ops.fp8 import rule as fp8_rule

CHECK_TOL = 2e-2
CHECKED = ("cuda", "cuda+fuse", "cuda+gather", "cuda+dswiglu", "cuda+fuse+dswiglu", "cuda-sm80",
           "cuda+regather", "cuda+fuse+regather", "cuda+dswiglu+regather", "cuda+fp8",
           "cuda+fp8all", "cuda+fp8-wo-fwd-bf16")  # checked against 'xla'
FP8_CHECK_TOL = 0.08
CHECK_TOKENS = 2048
CHECK_BYTES = 8 << 30


def _is_oom(ex: Exception) -> bool:
    s = str(ex)
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower()


def _failure(ex: Exception) -> str:
    if _is_oom(ex):
        return "OOM (RESOURCE_EXHAUSTED)"
    return f"failed: {type(ex).__name__}: {str(ex)[:200]}"


def check_tokens(shape: lc.Shape) -> int:
    """Tokens of the check: at most CHECK_TOKENS, and few enough that E x (T*k) x max(M, H)
    bf16 values (what XLA's ragged_dot may materialise) stay under CHECK_BYTES."""
    t = min(shape.t, CHECK_TOKENS, CHECK_BYTES // (2 * shape.e * shape.k * max(shape.m, shape.h)))
    return max(8, 1 << (max(t, 1).bit_length() - 1))


def chunked_rel_err(a, b, chunks: int = 16):
    """rel_err over slices of the leading dimension, float32 sums of squares per slice: the
    DeepSeek-like weight gradients are too large for one float64 copy beside the step's own
    buffers (that check ran out of memory on the H200)."""
    try:
        step = max(1, -(-a.shape[0] // chunks))
        num = den = 0.0
        for i in range(0, a.shape[0], step):
            da, db = a[i:i + step].astype(jnp.float32), b[i:i + step].astype(jnp.float32)
            num += float(jnp.sum(jnp.square(da - db)))
            den += float(jnp.sum(jnp.square(db)))
        return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))
    except Exception as ex:  # noqa: BLE001
        print("  rel_err failed:", repr(ex)[:200], flush=True)
        return None


def fp8_check_params(config, shape: lc.Shape, params: dict) -> tuple[dict, bool]:
    """(the params of a method's check, whether its FP8 form was given): with the form where
    `config` runs FP8 at the timed call's rows per expert (shape.t * k / E, one device) under
    its fp8_gemms rule (module doc), else params unchanged."""
    if config.fp8 is None or experts.FP8_WEIGHTS in params:
        return params, False
    if not fp8_rule.form_pays(config.fp8_gemms, shape.t * shape.k / shape.e):
        return params, False
    return mp.quantize_expert_weights(params, config), True


def verdict(row: dict) -> str:
    """PASS, FAIL, or NOT CHECKED where every error that was computed is within the row's
    tolerance and some could not be computed (chunked_rel_err ran out of memory): the method
    is not known wrong, only unchecked."""
    if row["ok"]:
        return "PASS"
    errs = row.get("rel_err") or {}
    if row.get("unchecked") and all(e < row["tol"] for e in errs.values() if e is not None):
        return f"NOT CHECKED ({', '.join(row['unchecked'])}: error not computed)"
    return "FAIL"


def check_against_xla(sh) -> list[dict]:
    """The CHECKED methods against 'xla' on the first check_tokens() tokens
    (module doc)."""
    t = check_tokens(sh.shape)
    x, cot = sh.x[:t], sh.cot[:t]
    ref = lc.block_fns(sh.config("xla"))
    ref_y = ref["fwd"](sh.params, x).y
    _, (ref_dp, ref_dx) = ref["fwd+bwd"](sh.params, x, cot)
    if sh.fused is not None:
        ref_dp = {
            **ref_dp, "wi_gate_up": ops.interleave_gate_up(ref_dp["wi_gate"], ref_dp["wi_up"])
        }
    out = []
    for method in CHECKED:
        if method not in sh.methods:
            continue
        row = dict(shape=sh.name, method=method, tokens=t, backend=sh.config(method).kernel_backend)
        try:
            f = lc.block_fns(sh.config(method))
            p, row["fp8_form_given"] = fp8_check_params(sh.config(method), sh.shape,
                                                        sh.block_params(method, "balanced"))
            with sh.forcing(method):  # traced (and compiled) at the first call of each
                errs = {"y": chunked_rel_err(f["fwd"](p, x).y, ref_y)}
                _, (dp, dx) = f["fwd+bwd"](p, x, cot)
            errs["dx"] = chunked_rel_err(dx, ref_dx)
            for n in dp:
                if n in ref_dp and n != "expert_bias":
                    errs["d" + n] = chunked_rel_err(dp[n], ref_dp[n])
            del dp, dx
            row["rel_err"] = errs
            tol = FP8_CHECK_TOL if "fp8" in method else CHECK_TOL
            row["ok"] = all(e is not None and e < tol for e in errs.values())
            row["unchecked"] = sorted(n for n, e in errs.items() if e is None)
            row["tol"] = tol
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            row.update(ok=False, error=_failure(ex))
        print(
            f"check {sh.name} {method} vs xla ({t} tokens): {verdict(row)} "
            f"{row.get('rel_err', row.get('error'))}",
            flush=True)
        out.append(row)
    return out
