"""Which expert GEMMs run in FP8: the measured per-GEMM rule of MoEConfig.fp8_gemms.

A weight w [E, K, N] (wi_gate / wi_up: K = d_model, N = d_ff; wo: K = d_ff, N = d_model) has
three GEMMs: the forward [R, K] x [K, N], the dgrad [R, N] x [N, K] (dx, K wide) and the wgrad
[K, R] x [R, N] per expert. `fp8_gemm_rule(k, n)` says which of them run in FP8; the others
run the bf16 grouped GEMM (ops.grouped_gemm) on the bf16 master weight. It is a rule like the
grouped GEMM's tile rule (ops.grouped_gemm_tiles.choose_config): a few thresholds, each read
off the H200 measurements named beside it.

    GEMM    FP8 when          why (benchmarks/results/; shapes A: K=4096, N=14336, 4096 rows
                              per expert; B: K=7168, N=2048, 1024 rows; C: K=2048, N=768, 512)
    fwd     always            its lhs comes as FP8 from the op that writes it (the permute, the
                              SwiGLU), so the kernel alone is its cost: fp8_bench_auto.json /
                              fp8_bench_interleaved.json rows `fp8` fwd A 1.48x / 1.72x, B
                              1.56x / 2.06x; fp8_bench_overlap.json C tile 5 (choose_tile's
                              there) 553 against bf16 324 TFLOP/s (1.71x); with the weights
                              quantized beforehand the whole layer's forward gains at every
                              shape (layer_bench_issues_36_37.json `cuda+fp8w` fwd: qwen3 1.11x,
                              deepseek_ep4 1.36x, mixtral 1.52x, deepseek 1.29x)
    dgrad   K >= 4096         it quantizes dy [R, N] in a pass of its own (L1): a cost per
                              FLOP of 1/K, so its gain grows with K. Rows `fp8+q` (the kernel
                              and that pass): C (K=2048) 0.96x (fp8_bench_tiles.json) and
                              0.99x (fp8_bench_overlap.json); A (K=4096) 1.35x
                              (fp8_bench_auto.json); B (K=7168) 1.37x (fp8_bench_auto.json),
                              1.68x (fp8_bench_interleaved.json)
    wgrad   min(K, N) >= 4096 both operands quantized in 128-row tiles per expert (L3, two
                              passes: a cost per FLOP of 1/K + 1/N) and the kernel's own gain
                              is the smallest (1.0-1.3x). Rows `fp8+q`: C 0.46x / 0.48x
                              (fp8_bench_tiles.json / fp8_bench_overlap.json), B (min 2048)
                              0.93x (fp8_bench_auto.json) and 1.07x (fp8_bench_interleaved.json);
                              A (min 4096) 1.10x and 1.14x; in the Mixtral-like layer (A's
                              shapes, the gate and up wgrads sharing one L3 of x) the FP8 wgrad
                              with its L3 is 15.4 ms against bf16's 18.2 (1.18x), in the
                              Qwen3-like layer 2.65 against 1.86 (0.70x)
                              (layer_breakdown_fp8_overlap.json)

The weight's own quantization (L2, once per optimizer step: quantize_expert_weights) is not in
the rule: its cost per step is fixed, so it pays with enough rows per expert per step; at one
micro-batch per step with few rows per expert it exceeds what the FP8 forward saves
(layer_bench_fp8_once_deepseek.json `cuda+fp8 @1` fwd 0.51x at 256 rows per expert, against
1.13x at 8 micro-batches).

MoEConfig.fp8_gemms: 'auto' (this rule, the default) or 'all' (every expert GEMM in FP8).
"""

from __future__ import annotations

import dataclasses

FP8_GEMMS = ("auto", "all")  # MoEConfig.fp8_gemms
GEMMS = ("fwd", "dgrad", "wgrad")
# The rule's thresholds (module doc: the rows that set each)
DGRAD_MIN_K = 4096
WGRAD_MIN_KN = 4096


@dataclasses.dataclass(frozen=True)
class Fp8Gemms:
    """Which of one weight's three GEMMs run in FP8 (the others in bf16)."""
    fwd: bool = True
    dgrad: bool = True
    wgrad: bool = True

    @property
    def all(self) -> bool:
        return self.fwd and self.dgrad and self.wgrad

    @property
    def any(self) -> bool:
        return self.fwd or self.dgrad or self.wgrad

    def label(self) -> str:
        """'fwd+dgrad+wgrad', 'fwd', ..., 'none': the GEMMs in FP8."""
        names = [g for g in GEMMS if getattr(self, g)]
        return "+".join(names) if names else "none"


ALL = Fp8Gemms()


def fp8_gemm_rule(k: int, n: int) -> Fp8Gemms:
    """The measured rule (module doc) for a weight [E, K, N]: forward always, dgrad when
    K >= DGRAD_MIN_K, wgrad when min(K, N) >= WGRAD_MIN_KN."""
    return Fp8Gemms(fwd=True, dgrad=k >= DGRAD_MIN_K, wgrad=min(k, n) >= WGRAD_MIN_KN)


def choose(mode: str, k: int, n: int) -> Fp8Gemms:
    """The FP8 GEMMs of a weight [E, K, N] under MoEConfig.fp8_gemms=mode."""
    if mode not in FP8_GEMMS:
        raise ValueError(f"fp8_gemms={mode!r} is invalid; valid: {FP8_GEMMS}")
    return ALL if mode == "all" else fp8_gemm_rule(k, n)


def weight_shapes(d_model: int, d_ff: int, gated: bool) -> dict[str, tuple[int, int]]:
    """{expert weight: (K, N)} of an FFN (moe.param_shapes' names)."""
    shapes = {"wi_gate": (d_model, d_ff)} if gated else {}
    return {**shapes, "wi_up": (d_model, d_ff), "wo": (d_ff, d_model)}


def choose_all(mode: str, d_model: int, d_ff: int, gated: bool) -> dict[str, Fp8Gemms]:
    """{expert weight: its Fp8Gemms} of an FFN under mode."""
    return {w: choose(mode, k, n) for w, (k, n) in weight_shapes(d_model, d_ff, gated).items()}


def describe(choices: dict[str, Fp8Gemms]) -> dict[str, dict[str, str]]:
    """{weight: {'fwd': 'fp8' | 'bf16', 'dgrad': ..., 'wgrad': ...}} (backend_info, benchmarks)."""
    return {w: {g: "fp8" if getattr(c, g) else "bf16" for g in GEMMS} for w, c in choices.items()}


def shares(choices: dict[str, Fp8Gemms]) -> dict[str, float]:
    """{'fwd' | 'dgrad' | 'wgrad': the share of the weights whose GEMM of that kind runs in FP8}
    ({} without weights): MoEFeedForward's summaries moe_fp8_fwd, moe_fp8_dgrad, moe_fp8_wgrad."""
    if not choices:
        return {}
    return {g: sum(getattr(c, g) for c in choices.values()) / len(choices) for g in GEMMS}


def info() -> dict:
    """The rule itself, for backend_info(): its name, the modes and the thresholds."""
    return {
        "rule": "moe_praxis.ops.fp8_rule.fp8_gemm_rule",
        "modes": FP8_GEMMS,
        "fwd": "always",
        "dgrad": f"K >= {DGRAD_MIN_K}",
        "wgrad": f"min(K, N) >= {WGRAD_MIN_KN}",
    }


def backend_entry(config=None) -> dict:
    """backend_info()'s 'fp8_gemms': {'rule': info()}, and with `config` (an MoEConfig with fp8
    set) 'mode': config.fp8_gemms and 'choice': describe(config.fp8_choices())."""
    out = {"rule": info()}
    if config is not None and config.fp8 is not None:
        out.update(mode=config.fp8_gemms, choice=describe(config.fp8_choices()))
    return out


def markdown_table() -> str:
    """docs/config.md's table of the rule (generated: python -m moe_praxis.config --write)."""
    i = info()
    rows = [
        "| GEMM of a weight [E, K, N] | FP8 under `fp8_gemms='auto'` | under `'all'` |",
        "|---|---|---|"
    ]
    rows += [f"| {g} | {i[g]} | always |" for g in GEMMS]
    return "\n".join(rows) + "\n"
