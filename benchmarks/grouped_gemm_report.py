"""The grouped GEMM benchmark's tables (`python -m benchmarks.bench_grouped_gemm`), from its
rows (dicts with shape, dist, op, method, ms, tflops and, per method, config, tiles, waves):
every row against dense, the summary of ours against dense, Pallas and batched, and the sm_80
kernels' summary (--sm80). Markdown, printed at the end of the run."""

from __future__ import annotations


def sm80_summary(rows) -> str:
    """One line per (shape, dist, op) with an sm80 row: the sm_80 kernels (the rule's tile, and
    the best tile timed) against dense cuBLAS, ragged_dot and ours (the Hopper kernels); speed
    ratios, > 1 means the sm_80 kernel is faster."""
    out = [
        "| shape | groups | op | dense | ragged_dot | ours (Hopper) | sm80 (config) "
        "| sm80 / dense | sm80 / ragged_dot | sm80 / ours | best sm80 tile | sm80, 1 group "
        "| sm80 / 1 group |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    keys = list(dict.fromkeys((r["shape"], r["dist"], r["op"]) for r in rows))
    for key in keys:
        get = {r["method"]: r for r in rows if (r["shape"], r["dist"], r["op"]) == key}
        s = get.get("sm80")
        if s is None:
            continue
        tiles = [r for name, r in get.items() if name == "sm80" or name.startswith("sm80[")]
        best = min(tiles, key=lambda r: r["ms"])

        def cell(r):
            return f"{r['ms']:.3f} ms, {r['tflops']:.0f}" if r else "-"

        def ratio(x):
            return f"{x['ms'] / s['ms']:.2f}" if x else "-"

        d, rg, o = get.get("dense"), get.get("ragged"), get.get("ours")
        one = get.get("sm80_1group")
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell(d)} | {cell(rg)} | {cell(o)} | "
                   f"{cell(s)} ({s['config']}) | {ratio(d)} | {ratio(rg)} | {ratio(o)} | "
                   f"{best['config']} ({best['tflops']:.0f}) | {cell(one)} | {ratio(one)} |")
    return "\n".join(out)


def summary_table(rows, skipped=()) -> str:
    """One line per (shape, dist, op): ms and TFLOP/s of each method, ours / dense, ours / pallas
    (speed ratios: > 1 means ours is faster). Dense, ours and Pallas are timed interleaved at
    each point (time_paired); dense is the same GEMM for both distributions."""
    dense = {(r["shape"], r["dist"], r["op"]): r for r in rows if r["method"] == "dense"}
    out = [
        "| shape | groups | op | dense | ragged_dot | Pallas (config) | ours (config) "
        "| ours / dense | ours / Pallas | ours: tiles, waves | batched | ours / batched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    keys = []
    for r in rows:
        if (r["shape"], r["dist"], r["op"]) not in keys:
            keys.append((r["shape"], r["dist"], r["op"]))

    def cell(r, method=""):
        if r:
            return f"{r['ms']:.3f} ms, {r['tflops']:.0f}"
        return "(skipped)" if method in skipped else "failed"

    for shape, dist, op in keys:
        get = {
            r["method"]: r
            for r in rows if (r["shape"], r["dist"], r["op"]) == (shape, dist, op)
        }
        d, o, p = dense.get((shape, dist, op)), get.get("ours"), get.get("pallas")
        pc = f" ({','.join(map(str, p['config']))})" if p else ""
        oc = f" ({o['config']})" if o else ""
        b = get.get("batched")  # balanced points only

        def ratio(x):  # ours' speed relative to x (> 1: ours faster)
            return f"{x['ms'] / o['ms']:.2f}" if x and o else "-"

        tw = f"{o['tiles']}, {o['waves']:.2f}" if o and o.get("waves") else "-"
        out.append(f"| {shape} | {dist} | {op} | {cell(d)} | {cell(get.get('ragged'), 'ragged')} | "
                   f"{cell(p, 'pallas')}{pc} | {cell(o)}{oc} | {ratio(d)} | {ratio(p)} | {tw} | "
                   f"{cell(b) if b else '-'} | {ratio(b)} |")
    return "\n".join(out)


def print_table(rows):
    dense = {(r["shape"], r["dist"], r["op"]): r["ms"] for r in rows if r["method"] == "dense"}
    print("\n| shape | dist | op | method | ms | TFLOP/s | x dense |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["method"].startswith("ours["):
            continue
        d = dense.get((r["shape"], r["dist"], r["op"]))
        ratio = f"{d / r['ms']:.2f}" if d else "-"
        print(f"| {r['shape']} | {r['dist']} | {r['op']} | {r['method']} | {r['ms']:.3f} | "
              f"{r['tflops']:.0f} | {ratio} |")
