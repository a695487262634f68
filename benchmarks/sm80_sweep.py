"""The sm_80 tile sweep's tables (`python -m benchmarks.bench_grouped_gemm --sm80 --sm80-tiles
all`): every tile of SM80_TILE_CONFIGS timed at each (shape, groups, op) next to dense cuBLAS
and ragged_dot, and the per-shape rankings that become the rule's table
(`moe_praxis.ops.grouped_gemm_sm80.SM80_MEASURED`).

Rows are bench_grouped_gemm's: dicts with shape, dist, op, method, ms, tflops and, for the sm_80
rows (method 'sm80' for the rule's tile, 'sm80[<config>]' for the others), config.
"""

from __future__ import annotations

import pprint


def sm80_rows(rows, key) -> dict[str, dict]:
    """config -> row of every sm_80 tile timed at key = (shape, dist, op)."""
    out = {}
    for r in rows:
        if (r["shape"], r["dist"], r["op"]) == key and r["method"].split("[")[0] == "sm80":
            out.setdefault(r["config"], r)
    return out


def sweep_table(rows, configs) -> str:
    """One line per (shape, groups, op): TFLOP/s of each tile of `configs` (the fastest in
    bold), the rule's tile, the best tile and its speed relative to dense cuBLAS and to
    ragged_dot (> 1: the sm_80 kernel is faster)."""
    short = [c[len("sm80_"):] for c in configs]
    out = [
        "| shape | groups | op | dense TFLOP/s | " + " | ".join(short) +
        " | rule's tile | best tile | best / dense | best / ragged_dot |",
        "|---|---|---|---|" + "---|" * len(configs) + "---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["shape"], r["dist"], r["op"]) for r in rows))
    for key in keys:
        tiles = sm80_rows(rows, key)
        if not tiles:
            continue
        get = {r["method"]: r for r in rows if (r["shape"], r["dist"], r["op"]) == key}
        best = min(tiles.values(), key=lambda r: r["ms"])
        cells = []
        for c in configs:
            r = tiles.get(c)
            text = f"{r['tflops']:.0f}" if r else "-"
            cells.append(f"**{text}**" if r is best else text)
        d, rg = get.get("dense"), get.get("ragged")
        rule = get.get("sm80", {}).get("config", "-")

        def ratio(x):
            return f"{x['ms'] / best['ms']:.2f}" if x else "-"

        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {d['tflops']:.0f} | "
                   if d else f"| {key[0]} | {key[1]} | {key[2]} | - | ")
        out[-1] += " | ".join(cells) + (f" | {rule} | {best['config']} | {ratio(d)} | "
                                        f"{ratio(rg)} |")
    return "\n".join(out)


def winners(rows, shapes: dict, dist: str = "balanced") -> dict[str, list]:
    """{op: [((E, M, K, N), (configs fastest first)), ...]} from the rows of `dist`, in the
    form of SM80_MEASURED; `shapes`: shape name -> (E, M, K, N)."""
    out: dict[str, list] = {}
    keys = list(dict.fromkeys((r["shape"], r["dist"], r["op"]) for r in rows))
    for shape, d, op in keys:
        tiles = sm80_rows(rows, (shape, d, op))
        if d != dist or not tiles:
            continue
        ranking = tuple(c for c, _ in sorted(tiles.items(), key=lambda kv: kv[1]["ms"]))
        out.setdefault(op, []).append((tuple(shapes[shape]), ranking))
    return out


def winners_literal(table: dict[str, list]) -> str:
    """`table` (winners()) as the Python literal of SM80_MEASURED, ready to paste."""
    return "SM80_MEASURED = " + pprint.pformat(
        {
            op: tuple(entries)
            for op, entries in table.items()
        }, width=100, sort_dicts=False)
