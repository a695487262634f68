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
(threads: the tokenizer libraries encode outside the GIL), ``ENCODE_BATCH`` documents per
library call, with a tqdm bar of documents and MB/s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments import documents
from experiments.tokenizer import EncodedBatch, Tokenizer

FORMAT = 2  # bump when the layout changes
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


def _with_specials(enc: EncodedBatch, bos, eos) -> EncodedBatch:
    """Each document of ``enc`` with ``bos`` before it and ``eos`` after it (None: none);
    they cover no bytes of text."""
    ids, nbytes, lens = enc
    for tid, at_end in ((bos, False), (eos, True)):
        if tid is not None:
            ends = np.cumsum(lens)
            at = ends if at_end else ends - lens
            ids, nbytes, lens = np.insert(ids, at, tid), np.insert(nbytes, at, 0), lens + 1
    return EncodedBatch(ids, nbytes, lens)


def _tokenize_file(i: int, f: Path, tok: Tokenizer, text_field: str, add_bos: bool, add_eos: bool,
                   tmp: Path, progress) -> dict:
    """Writes shard ``i`` (tokens, bytes, document lengths) of file ``f`` into ``tmp``."""
    parts = []
    bos, eos = tok.bos_id if add_bos else None, tok.eos_id if add_eos else None
    docs = documents.read_documents(f, text_field)
    while batch := list(itertools.islice(docs, ENCODE_BATCH)):
        parts.append(_with_specials(tok.encode_batch(batch), bos, eos))
        progress(int(parts[-1].token_bytes.sum()), len(batch))
    empty = (np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.int64))
    ids, nbytes, lens = (np.concatenate(field) for field in zip(*parts, empty))
    np.save(tmp / f"{i:06d}.tokens.npy", ids)
    np.save(tmp / f"{i:06d}.bytes.npy", nbytes)
    np.save(tmp / f"{i:06d}.lens.npy", lens)
    return {"documents": len(lens), "bytes": int(nbytes.sum())}


class _Progress:
    """The tqdm bar of a build (MB/s of text, documents), updated once per encoded batch from
    every worker thread."""

    def __init__(self, total_bytes: int, show: bool):
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="tokenizing",
            file=sys.stderr,
            delay=2.0,  # a build of a few seconds draws nothing
            dynamic_ncols=True) if show else None
        self.documents = 0
        self.lock = threading.Lock()

    def __call__(self, nbytes: int, ndocs: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.documents += ndocs
                self.bar.update(nbytes)
                self.bar.set_postfix(documents=f"{self.documents:,}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
        progress = _Progress(sum(os.stat(f).st_size for f in files), progress)
        t0 = time.perf_counter()
        # threads: the libraries encode outside the GIL (and over the cores: sentencepiece's
        # num_threads, tokenizers' rayon pool), so one reads and parses a file while another
        # encodes; more threads than cores would only wait
        workers = workers or min(len(files), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
            parts = list(
                pool.map(
                    lambda a: _tokenize_file(a[0], a[1], tok, text_field, add_bos, add_eos, tmp,
                                             progress), enumerate(files)))
        progress.close()
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
