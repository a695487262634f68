r"""Tokenization throughput of the data pipeline's cache build (``experiments.data.token_cache``):
MB/s of UTF-8 text from files to memory-mapped token arrays, on varied text: the source of every
module of this Python's standard library (tests included), each module one ``.txt`` document,
no text repeated (a repeated text would be cheap for a BPE cache). A byte-level BPE
``tokenizer.json`` and a lossless SentencePiece model are trained here on the first
``--train_mb`` MB of it (``experiments.tokenizer``, ``python -m experiments.tokenizer``; nothing is downloaded). The BPE is
measured with the engine ``experiments.tokenizer`` picks (``tiktoken`` where it gives the ids
of ``tokenizers``) and, as ``bpe:tokenizers``, encoded by ``tokenizers`` (the baseline).

Prints a table and writes JSON: wall MB/s of the build (one process: ``--workers`` threads
across files, each encoding batches of documents with the library's own threads) and MB per
CPU-second (user + system time of the process over all its threads), with the machine's load
average (``os.getloadavg``) before and after each build: a shared machine's load lowers wall
MB/s and barely MB per CPU-second.

  python -m benchmarks.tokenize_throughput --out benchmarks/results/tokenize_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from experiments.data import token_cache
from experiments.tokenizer.train import train_tokenizer


def stdlib_sources(limit_mb: float = 0.0) -> list[Path]:
    """Every ``.py`` file of the standard library (site-packages left out), sorted; the first
    ``limit_mb`` MB of them when given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if limit_mb:
        total, kept = 0, []
        for p in files:
            if total >= limit_mb * 1e6:
                break
            kept.append(p)
            total += p.stat().st_size
        files = kept
    return files


def _corpus(d: Path, sources: list[Path]) -> list[Path]:
    """The sources as UTF-8 ``.txt`` documents (a file that is not UTF-8 left out)."""
    out = []
    for i, src in enumerate(sources):
        try:
            text = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "\0" in text or not text:
            continue
        p = d / f"{i:05d}_{src.stem}.txt"
        p.write_text(text, encoding="utf-8")
        out.append(p)
    return out


def measure(kind: str, tok, files, repeats: int, workers) -> dict:
    best = None
    for _ in range(repeats):
        cache = tempfile.mkdtemp()
        try:
            load0 = os.getloadavg()
            t0, c0 = time.perf_counter(), time.process_time()
            c = token_cache.build_or_load(files,
                                          tok,
                                          add_eos=True,
                                          cache_dir=cache,
                                          progress=False,
                                          workers=workers)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if best is None or dt < best["seconds"]:
            best = {
                "seconds": dt,
                "cpu_seconds": dc,
                "bytes": c.meta["bytes"],
                "tokens": c.meta["tokens"],
                "documents": c.meta["documents"],
                "files": c.meta["files"],
                "load_average_before": load0,
                "load_average_after": os.getloadavg(),
            }
    best["mb_per_s"] = best["bytes"] / best["seconds"] / 1e6
    best["mb_per_cpu_s"] = best["bytes"] / best["cpu_seconds"] / 1e6
    best["kind"] = kind
    best["vocab_size"] = tok.vocab_size
    best["engine"] = tok.engine  # the library that encodes
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=0.0, help="the first MB of the sources (0: all)")
    ap.add_argument("--train_mb", type=float, default=2.0, help="MB the tokenizers train on")
    ap.add_argument("--vocab_size", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=2, help="builds per tokenizer; the best kept")
    ap.add_argument("--workers",
                    type=int,
                    default=None,
                    help="files tokenized at once (default: token_cache's, the cores)")
    ap.add_argument("--kinds",
                    default="bpe,bpe:tokenizers,sentencepiece",
                    help="bpe (its engine: tiktoken where exact), bpe:tokenizers (the same BPE "
                    "encoded by tokenizers), sentencepiece")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    rows, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "corpus").mkdir()
        files = _corpus(d / "corpus", stdlib_sources(args.mb))
        train_files = _corpus(d, stdlib_sources(args.train_mb))
        texts = [p.read_text(encoding="utf-8") for p in train_files]
        for kind in args.kinds.split(","):
            out = d / ("sp.model" if kind == "sentencepiece" else "tokenizer.json")
            tok = train_tokenizer(texts, kind.split(":")[0], args.vocab_size, out)
            if kind == "bpe:tokenizers":  # the same file without tiktoken: the baseline
                tok.tiktoken, tok.engine = None, "tokenizers"
            rows.append(measure(kind, tok, files, args.repeats, args.workers))
    print(f"{'tokenizer':<14} {'engine':<14} {'vocab':>6} {'MB':>7} {'files':>6} {'tokens':>10} "
          f"{'s':>7} {'cpu s':>7} {'MB/s':>7} {'MB/cpu-s':>9} {'load before/after':>18}")
    for r in rows:
        load = f"{r['load_average_before'][0]:.2f}/{r['load_average_after'][0]:.2f}"
        print(f"{r['kind']:<14} {r['engine']:<14} {r['vocab_size']:>6} {r['bytes'] / 1e6:>7.1f} "
              f"{r['files']:>6} {r['tokens']:>10} {r['seconds']:>7.2f} {r['cpu_seconds']:>7.2f} "
              f"{r['mb_per_s']:>7.2f} {r['mb_per_cpu_s']:>9.2f} {load:>18}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} cpus)")
    if args.out:
        meta = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "python": platform.python_version(),
            "corpus": "the standard library's .py sources, one .txt document each",
            "workers": args.workers,
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
