"""Tokenize once, then read: the tokenized corpus as memory-mapped arrays in a cache.

A cache entry is a directory ``<cache_dir>/<key>`` named by the sha256 of what its content
depends on: every file's path, size and modification time, the tokenizer's file hash and the
settings (text field, BOS / EOS). It holds ``tokens.npy`` (uint32, every document's tokens one
after another), ``token_bytes.npy`` (uint32, the UTF-8 bytes of text each token covers; 0 for
BOS / EOS), ``doc_starts.npy`` (int64 [documents + 1], where each document starts) and
``meta.json``. A change to any file, to the tokenizer or to the settings gives another key, so
another entry is built.

A build writes a temporary directory ``.tmp.<key>.<pid>`` and renames it into place when
everything is written; an interrupted build leaves only a temporary directory, which no
reader trusts (the next build of that key removes it). Files are tokenized in parallel
(threads: the tokenizer libraries encode outside the GIL) with a tqdm bar of documents and
MB/s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments import documents
from experiments.tokenizer import Tokenizer

FORMAT = 1  # bump when the layout changes
ENCODE_BATCH = 256  # documents encoded per library call


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe_praxis" / "tokens"


def cache_key(files, tok: Tokenizer, settings: dict) -> str:
    stats = []
    for f in files:
        st = os.stat(f)
        stats.append([str(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps(
        {
            "format": FORMAT,
            "files": stats,
            "tokenizer": tok.sha256 or tok.name,
            "settings": settings
        },
        sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclasses.dataclass
class TokenizedCorpus:
    """The arrays of one cache entry (memory-mapped) and its meta."""

    path: Path
    tokens: np.ndarray  # [N] uint32
    token_bytes: np.ndarray  # [N] uint32
    doc_starts: np.ndarray  # [D + 1] int64
    meta: dict
    built: bool  # this call built it (False: reused)

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts) - 1


def _open(path: Path, built: bool) -> TokenizedCorpus:
    load = lambda n: np.load(path / n, mmap_mode="r")  # noqa: E731
    return TokenizedCorpus(path=path,
                           tokens=load("tokens.npy"),
                           token_bytes=load("token_bytes.npy"),
                           doc_starts=load("doc_starts.npy"),
                           meta=json.loads((path / "meta.json").read_text()),
                           built=built)


def _tokenize_file(i: int, f: Path, tok: Tokenizer, text_field: str, add_bos: bool, add_eos: bool,
                   tmp: Path, bar) -> dict:
    """Writes shard ``i`` (tokens, bytes, document lengths) of file ``f`` into ``tmp``."""
    ids, nbytes, lens = [], [], []
    n_bytes = 0
    pending = []

    def flush():
        nonlocal n_bytes
        for (t, b), text in zip(tok.encode_batch(pending), pending):
            if add_bos:
                t, b = np.concatenate([[tok.bos_id], t]), np.concatenate([[0], b])
            if add_eos:
                t, b = np.concatenate([t, [tok.eos_id]]), np.concatenate([b, [0]])
            ids.append(np.asarray(t, np.uint32))
            nbytes.append(np.asarray(b, np.uint32))
            lens.append(len(t))
        size = sum(len(t.encode("utf-8")) for t in pending)
        n_bytes += size
        if bar is not None:
            bar.update(size)
            bar.set_postfix(documents=f"{len(lens):,}", refresh=False)
        pending.clear()

    for text in documents.read_documents(f, text_field):
        pending.append(text)
        if len(pending) >= ENCODE_BATCH:
            flush()
    if pending:
        flush()
    cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
    np.save(tmp / f"{i:06d}.tokens.npy", cat(ids, np.uint32))
    np.save(tmp / f"{i:06d}.bytes.npy", cat(nbytes, np.uint32))
    np.save(tmp / f"{i:06d}.lens.npy", np.asarray(lens, np.int64))
    return {"documents": len(lens), "bytes": n_bytes}


def _merge(tmp: Path, n_files: int) -> tuple[int, int]:
    """Joins the per-file shards into one memory-mappable array per field."""
    lens = [np.load(tmp / f"{i:06d}.lens.npy") for i in range(n_files)]
    all_lens = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    total = int(all_lens.sum())
    starts = np.concatenate([[0], np.cumsum(all_lens)]).astype(np.int64)
    np.save(tmp / "doc_starts.npy", starts)
    for field, name in (("tokens", "tokens.npy"), ("bytes", "token_bytes.npy")):
        out = np.lib.format.open_memmap(tmp / name, mode="w+", dtype=np.uint32, shape=(total, ))
        at = 0
        for i in range(n_files):
            part = np.load(tmp / f"{i:06d}.{field}.npy")
            out[at:at + len(part)] = part
            at += len(part)
            (tmp / f"{i:06d}.{field}.npy").unlink()
        out.flush()
        del out
    for i in range(n_files):
        (tmp / f"{i:06d}.lens.npy").unlink()
    return total, len(all_lens)


def build_or_load(files,
                  tok: Tokenizer,
                  *,
                  text_field: str = "text",
                  add_bos: bool = False,
                  add_eos: bool = False,
                  cache_dir=None,
                  progress: bool = True,
                  workers: int | None = None) -> TokenizedCorpus:
    """The tokenized corpus of ``files``: reused from the cache, or built and cached."""
    settings = {"text_field": text_field, "add_bos": add_bos, "add_eos": add_eos}
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key = cache_key(files, tok, settings)
    final = root / key
    if (final / "meta.json").is_file():
        return _open(final, built=False)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".tmp.{key}.*"):  # an interrupted build of this key
        pid = stale.name.rsplit(".", 1)[-1]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp.{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        total_bytes = sum(os.stat(f).st_size for f in files)
        bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="tokenizing",
            file=sys.stderr,
            delay=2.0,  # a build of a few seconds draws nothing
            dynamic_ncols=True) if progress else None
        t0 = time.perf_counter()
        workers = workers or min(len(files), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
            parts = list(
                pool.map(
                    lambda a: _tokenize_file(a[0], a[1], tok, text_field, add_bos, add_eos, tmp, bar
                                             ), enumerate(files)))
        if bar is not None:
            bar.close()
        n_tokens, n_docs = _merge(tmp, len(files))
        meta = {
            "files": len(files),
            "documents": n_docs,
            "tokens": n_tokens,
            "bytes": sum(p["bytes"] for p in parts),
            "tokenizer": tok.name,
            "tokenizer_sha256": tok.sha256,
            "seconds": round(time.perf_counter() - t0, 3),
            **settings
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process built the same key first: use its entry
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _open(final, built=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()
