"""The layer benchmark's token-count sweep (`python -m benchmarks.layer --tokens 4096,...,65536`):
every shape at each token count T, and each (shape, method, pass)'s share of ideal per T.

The target: from T=4096 to T=65536 each shape's fwd and fwd+bwd share of ideal stay within
SWEEP_POINTS of their share at T=SWEEP_REF (the cost grows linearly with tokens).
"""

from __future__ import annotations

import argparse

from benchmarks import layer_cases as lc

SWEEP_REF = 16384  # the token count the other shares are compared with
SWEEP_POINTS = 5.0  # percentage points of ideal


def parse_tokens(text: str) -> list[int]:
    """'4096,16384' -> [4096, 16384]: positive, and at most 2048 or a multiple of it (the Praxis
    layers' [T / S, S, M] batch with S = min(T, 2048))."""
    try:
        ts = [int(s) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: need comma-separated ints") from None
    bad = [t for t in ts if t <= 0 or (t > 2048 and t % 2048)]
    if bad or not ts:
        raise argparse.ArgumentTypeError(
            f"--tokens {bad or text!r} invalid: each T must be positive and at most 2048 or a "
            "multiple of 2048")
    return ts


def runs(names: list[str], shapes: dict, tokens: list[int] | None) -> list[tuple[str, lc.Shape]]:
    """(label, shape) for each shape name, at its own T (label = name) or at each T of `tokens`
    (label = name@T<T>)."""
    if not tokens:
        return [(n, shapes[n]) for n in names]
    return [(f"{n}@T{t}", shapes[n]._replace(t=t)) for n in names for t in tokens]


def base_name(label: str) -> str:
    """'qwen3@T4096' -> 'qwen3' (the name targets and sizes are keyed by)."""
    return label.split("@", 1)[0]


def summary(rows: list[dict]) -> list[dict]:
    """Per (shape, method, pass), balanced load: share of ideal at each T and the largest
    distance (points) from the share at T=SWEEP_REF (None where that T did not run)."""
    shares: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r["load"] != "balanced" or not r.get("pct_ideal") or r["method"] == "ideal":
            continue
        key = (base_name(r["shape"]), r["method"], r["pass_"])
        shares.setdefault(key, {})[r["tokens"]] = r["pct_ideal"]
    out = []
    for (shape, method, pass_), by_t in shares.items():
        ref = by_t.get(SWEEP_REF)
        dev = max(abs(v - ref) for v in by_t.values()) if ref is not None else None
        out.append(
            dict(shape=shape,
                 method=method,
                 pass_=pass_,
                 pct_ideal_by_tokens=dict(sorted(by_t.items())),
                 max_points_from_ref=dev,
                 verdict=None if dev is None else ("PASS" if dev <= SWEEP_POINTS else "FAIL")))
    return out


def table(summ: list[dict]) -> str:
    ts = sorted({t for s in summ for t in s["pct_ideal_by_tokens"]})
    head = " | ".join(f"T={t}" for t in ts)
    out = [
        f"| shape | pass | method | {head} | max points from T={SWEEP_REF} | "
        f"<= {SWEEP_POINTS:.0f} points |", "|" + "---|" * (5 + len(ts))
    ]
    for s in summ:
        cells = " | ".join(
            f"{s['pct_ideal_by_tokens'][t]:.0f}%" if t in s["pct_ideal_by_tokens"] else "-"
            for t in ts)
        dev = "-" if s["max_points_from_ref"] is None else f"{s['max_points_from_ref']:.1f}"
        out.append(f"| {s['shape']} | {s['pass_']} | {s['method']} | {cells} | {dev} | "
                   f"{s['verdict'] or '-'} |")
    return "\n".join(out)
