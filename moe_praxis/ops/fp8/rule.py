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

The weight's own quantization (L2: quantize_expert_weights, once per optimizer step in the
runner, else in every moe_block call) costs about 1.3 ps per weight element at every shape (it
reads the bf16 weight and writes q, qt and the scales): a fixed cost per quantization, which
the FP8 GEMMs repay in proportion to the rows it serves. So under 'auto' a layer runs FP8 only
when its weights' FP8 form serves at least FORM_MIN_ROWS rows per (local) expert: the rows per
expert of one call times the calls that share one quantization (`form_pays`); below that the
whole layer runs bf16 (its wgrad too: a wgrad in FP8 pays only at K, N >= 4096, where layers
have plenty of rows). Measured on the H200, layer_bench_fp8_microbatches.json, fwd+bwd, FP8
('auto') over bf16 with the form made once per n calls of T rows (`cuda+fp8 @n`), and the
rows per expert where the two break even (quantization ms / the FP8 form's gain per call):

    shape (rows per expert at n=1)    @1     @2     @4     @8     break-even rows per expert
    qwen3 (1024)                      0.95x  0.99x  1.01x  1.02x  2680
    deepseek_ep4 (1024)               0.96x  1.02x  1.05x  1.07x  1530
    mixtral (4096)                    1.29x  1.32x  1.34x  1.34x   510
    deepseek (256)                    0.83x  0.97x  1.06x  1.11x   610

At FORM_MIN_ROWS = 2048 no measured point runs slower than bf16 by more than qwen3 @2's 1%,
and one gain is given up (deepseek @4, 1.06x, runs bf16). A form given to moe_block (made by
the caller, whose rows per quantization moe_block cannot see) is used: its cost is spent.

MoEConfig.fp8_gemms: 'auto' (this rule, the default), 'all' (every expert GEMM in FP8, at
any rows), or the GEMMs to run in FP8 named and joined by '+' ('fwd', 'fwd+dgrad', 'dgrad+wgrad',
...: the same GEMMs of every expert weight, at any rows; the others in bf16 on the master
weight), as TransformerEngine's `override_linear_precision` keeps chosen GEMMs out of FP8: for
training-quality runs that change one GEMM at a time, or to keep a GEMM out of FP8 by choice.
Per weight: WEIGHT=GEMMS entries joined by ',' ('wi=fwd,wo=none': the gate and up projections'
forwards in FP8, everything else bf16; 'wo=fwd': only the down projection's forward), WEIGHT one
of WEIGHTS or 'wi' (the gate and up projections), GEMMS as above, 'all' or 'none'; a weight not
named runs bf16. A quality run that finds a gap with 'fwd' (benchmarks.fp8_quality) bisects it
over the weights this way.
"""

from __future__ import annotations

import dataclasses

FP8_GEMMS = ("auto", "all")  # MoEConfig.fp8_gemms' named modes (also: GEMMS joined by '+')
GEMMS = ("fwd", "dgrad", "wgrad")
EXAMPLE = "fwd+dgrad"  # GEMMs named by hand: the wgrad in bf16
WEIGHTS = ("wi_gate", "wi_up", "wo")  # moe.param_shapes' expert weights
WEIGHT_GROUPS = {"wi": ("wi_gate", "wi_up")}  # names for several weights in the per-weight form
VALID = (f"'auto', 'all', or GEMMs from {GEMMS} joined by '+', e.g. {EXAMPLE!r}, or per weight "
         f"WEIGHT=GEMMS joined by ',' (WEIGHT from {WEIGHTS} or 'wi' for the gate and up "
         "projections; GEMMS as above, 'all' or 'none'; a weight not named runs bf16), e.g. "
         "'wi=fwd,wo=none'")
# The rule's thresholds (module doc: the rows that set each)
DGRAD_MIN_K = 4096
WGRAD_MIN_KN = 4096
FORM_MIN_ROWS = 2048  # rows per expert per quantization of the weights


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
NONE = Fp8Gemms(fwd=False, dgrad=False, wgrad=False)


def _gemms(text: str, mode) -> Fp8Gemms:
    """'fwd+dgrad' (GEMMs joined by '+') or 'all' as an Fp8Gemms; ValueError otherwise."""
    if text == "all":
        return ALL
    names = text.split("+")
    if not text or any(g not in GEMMS for g in names) or len(set(names)) != len(names):
        raise ValueError(f"fp8_gemms={mode!r} is invalid; valid: {VALID}")
    return Fp8Gemms(**{g: g in names for g in GEMMS})


def _per_weight(mode: str) -> dict[str, Fp8Gemms]:
    """'wi=fwd,wo=none' as {weight: Fp8Gemms} of the weights named; ValueError for an unknown
    or repeated weight, a part without '=', or no FP8 GEMM at all."""
    out = {}
    for part in mode.split(","):
        weight, eq, gemms = part.partition("=")
        names = WEIGHT_GROUPS.get(weight, (weight, ))
        if not eq or any(n not in WEIGHTS or n in out for n in names):
            raise ValueError(f"fp8_gemms={mode!r} is invalid; valid: {VALID}")
        for n in names:
            out[n] = NONE if gemms == "none" else _gemms(gemms, mode)
    if not any(c.any for c in out.values()):
        raise ValueError(f"fp8_gemms={mode!r} is invalid (it runs no GEMM in FP8: leave fp8 "
                         f"None for that); valid: {VALID}")
    return out


def parse(mode) -> Fp8Gemms | dict[str, Fp8Gemms] | None:
    """MoEConfig.fp8_gemms as the GEMMs it names: None for 'auto' (the rule, per weight), ALL
    for 'all', the '+'-joined GEMMs ('fwd+dgrad': forward and dgrad in FP8, wgrad in bf16) of
    every weight, or {weight: Fp8Gemms} of the per-weight form ('wi=fwd,wo=none'; the weights
    not named: NONE). A ValueError names the value and what is valid (an unknown or repeated
    name, none)."""
    if mode == "auto":
        return None
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"fp8_gemms={mode!r} is invalid; valid: {VALID}")
    return _per_weight(mode) if "=" in mode else _gemms(mode, mode)


def fp8_gemm_rule(k: int, n: int) -> Fp8Gemms:
    """The measured rule (module doc) for a weight [E, K, N]: forward always, dgrad when
    K >= DGRAD_MIN_K, wgrad when min(K, N) >= WGRAD_MIN_KN."""
    return Fp8Gemms(fwd=True, dgrad=k >= DGRAD_MIN_K, wgrad=min(k, n) >= WGRAD_MIN_KN)


def form_pays(mode: str, rows_per_form: float) -> bool:
    """Whether a layer runs FP8 under mode when its weights' FP8 form serves `rows_per_form`
    rows per (local) expert per quantization (module doc): 'all' always, 'auto' at
    rows_per_form >= FORM_MIN_ROWS, the GEMMs named by hand ('fwd+dgrad', ...) always."""
    return parse(mode) is not None or rows_per_form >= FORM_MIN_ROWS


def weight_names(gated: bool) -> tuple[str, ...]:
    """An FFN's expert weights (moe.param_shapes' names): WEIGHTS, less wi_gate without a gate."""
    return WEIGHTS if gated else WEIGHTS[1:]


def weight_shapes(d_model: int, d_ff: int, gated: bool) -> dict[str, tuple[int, int]]:
    """{expert weight: (K, N)} of an FFN."""
    kn = {"wi_gate": (d_model, d_ff), "wi_up": (d_model, d_ff), "wo": (d_ff, d_model)}
    return {w: kn[w] for w in weight_names(gated)}


def _missing(named, gated: bool) -> list[str]:
    return sorted(set(named) - set(weight_names(gated))) if isinstance(named, dict) else []


def missing_weights(mode: str, gated: bool) -> list[str]:
    """The weights a per-weight mode names that an FFN (gated or not) has not: wi_gate without
    a gate ([] for every other mode)."""
    return _missing(parse(mode), gated)


def choose_all(mode: str, d_model: int, d_ff: int, gated: bool) -> dict[str, Fp8Gemms]:
    """{expert weight: its Fp8Gemms} of an FFN under mode. A per-weight mode naming a weight
    the FFN has not (missing_weights) is a ValueError, not ignored."""
    named = parse(mode)
    extra = _missing(named, gated)
    if extra:
        raise ValueError(f"fp8_gemms={mode!r} names {extra}, which this FFN has not (gated="
                         f"{gated}: its weights are {weight_names(gated)})")
    shapes = weight_shapes(d_model, d_ff, gated)
    if isinstance(named, dict):
        return {w: named.get(w, NONE) for w in shapes}
    return {w: fp8_gemm_rule(k, n) if named is None else named for w, (k, n) in shapes.items()}


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
    layer = (f"FP8 when its weights' FP8 form serves >= {FORM_MIN_ROWS} rows per expert per "
             "quantization, else bf16")
    return {
        "rule": "moe_praxis.ops.fp8.rule.fp8_gemm_rule",
        "modes": FP8_GEMMS + (f"GEMMs joined by '+' (e.g. {EXAMPLE!r})", ),
        "fwd": "always",
        "dgrad": f"K >= {DGRAD_MIN_K}",
        "wgrad": f"min(K, N) >= {WGRAD_MIN_KN}",
        "layer": layer,
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
        "| GEMM of a weight [E, K, N] | FP8 under `fp8_gemms='auto'` | under `'all'` | under "
        f"`{EXAMPLE!r}` (GEMMs named, joined by `+`) |", "|---|---|---|---|"
    ]
    named = parse(EXAMPLE)
    rows += [
        f"| {g} | {i[g]} | always | {'always' if getattr(named, g) else 'never'} |" for g in GEMMS
    ]
    return "\n".join(rows) + "\n"
