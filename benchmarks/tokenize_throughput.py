r"""Tokenization throughput of the data pipeline's cache build (``experiments.token_cache``):
MB/s of UTF-8 text from files to memory-mapped token arrays, with a byte-level BPE
``tokenizer.json`` and a SentencePiece model trained here on pydoc's topics (nothing is
downloaded). The corpus: the topics, copied to make ``--mb`` MB, in ``--files`` .jsonl files
(one document per topic copy). Prints a table and writes JSON: wall MB/s and MB per CPU-second
(the process's user + system time over all its threads), since a shared machine's load lowers
the first and barely the second; the load average before and after is in ``meta``.

  python -m benchmarks.tokenize_throughput --mb 16 --out benchmarks/results/tokenize_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from pydoc_data import topics

from experiments import documents, token_cache
from experiments.train_tokenizer import train_tokenizer


def _corpus(d: Path, mb: float, files: int) -> list[Path]:
    docs = [topics.topics[k] for k in sorted(topics.topics)]
    per = sum(len(t.encode()) for t in docs)
    copies = max(1, round(mb * 1e6 / per))
    paths = []
    for i in range(files):
        p = d / f"part{i:03d}.jsonl"  # a document per line: a topic, once per copy
        mine = [f"{c}:{t}" for c in range(i, copies, files) for t in docs]
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in mine))
        paths.append(p)
    return paths


def measure(kind: str, tok, files, repeats: int) -> dict:
    best = None
    for r in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            t0, c0 = time.perf_counter(), time.process_time()
            c = token_cache.build_or_load(files, tok, add_eos=True, cache_dir=cache, progress=False)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if best is None or dt < best["seconds"]:
            best = {
                "seconds": dt,
                "cpu_seconds": dc,
                "bytes": c.meta["bytes"],
                "tokens": c.meta["tokens"],
                "documents": c.meta["documents"]
            }
    best["mb_per_s"] = best["bytes"] / best["seconds"] / 1e6
    best["mb_per_cpu_s"] = best["bytes"] / best["cpu_seconds"] / 1e6
    best["kind"] = kind
    best["vocab_size"] = tok.vocab_size
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="corpus size in MB of text")
    ap.add_argument("--files", type=int, default=8, help="files the corpus is written as")
    ap.add_argument("--vocab_size", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2, help="builds per tokenizer; the best kept")
    ap.add_argument("--kinds", default="bpe,sentencepiece")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    rows, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        files = _corpus(d, args.mb, args.files)
        texts = [topics.topics[k] for k in sorted(topics.topics)]
        for kind in args.kinds.split(","):
            out = d / ("tokenizer.json" if kind == "bpe" else "sp.model")
            tok = train_tokenizer(texts, kind, args.vocab_size, out)
            rows.append(measure(kind, tok, files, args.repeats))
    print(f"{'tokenizer':<14} {'vocab':>6} {'MB':>7} {'docs':>7} {'tokens':>10} {'s':>7} "
          f"{'cpu s':>7} {'MB/s':>7} {'MB/cpu-s':>9}")
    for r in rows:
        print(f"{r['kind']:<14} {r['vocab_size']:>6} {r['bytes'] / 1e6:>7.1f} {r['documents']:>7} "
              f"{r['tokens']:>10} {r['seconds']:>7.2f} {r['cpu_seconds']:>7.2f} "
              f"{r['mb_per_s']:>7.2f} {r['mb_per_cpu_s']:>9.2f}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} cpus)")
    if args.out:
        meta = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "python": platform.python_version(),
            "files": args.files,
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
