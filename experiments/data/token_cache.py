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
reader trusts (the next build of that key removes it). Consecutive files are grouped into
shards of about ``SHARD_BYTES`` of text, tokenized in parallel by threads (the tokenizer
libraries encode outside the GIL and over the cores), ``ENCODE_BATCH`` documents per library
call (a call spans small files), with a tqdm bar of documents and MB/s. A build holds one batch
per thread in memory: each shard's tokens go to disk as they are encoded, and the shards are
joined through memory maps; a reader maps the arrays (``np.load(mmap_mode="r")``) and reads the windows and
rows it needs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

from experiments.tokenizer import documents
from experiments.tokenizer import EncodedBatch, Tokenizer

FORMAT = 2  # bump when the layout changes
ENCODE_BATCH = 256  # documents encoded per library call
SHARD_BYTES = 1 << 20  # of files' text tokenized as one shard (one worker's task)
# a file's shard while building: raw arrays, appended batch by batch
SHARD_FIELDS = (("tokens", np.uint32), ("bytes", np.uint32), ("lens", np.int64))


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


def _tokenize_files(i: int, files, tok: Tokenizer, text_field: str, add_bos: bool, add_eos: bool,
                    tmp: Path, progress) -> dict:
    """Writes shard ``i`` of ``files`` (consecutive files, their documents in order) into
    ``tmp``: raw arrays of its tokens, their bytes and the document lengths (``SHARD_FIELDS``),
    appended one encoded batch of up to ``ENCODE_BATCH`` documents at a time (a batch spans
    files: many small files are encoded together)."""
    bos, eos = tok.bos_id if add_bos else None, tok.eos_id if add_eos else None
    docs = (d for f in files for d in documents.read_documents(f, text_field))
    n_docs = n_bytes = 0
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(open(tmp / f"{i:06d}.{n}", "wb")) for n, _ in SHARD_FIELDS]
        while batch := list(itertools.islice(docs, ENCODE_BATCH)):
            enc = _with_specials(tok.encode_batch(batch), bos, eos)
            for a, out, (_, dtype) in zip(enc, outs, SHARD_FIELDS):
                np.asarray(a, dtype).tofile(out)
            nbytes = int(enc.token_bytes.sum())
            n_docs, n_bytes = n_docs + len(batch), n_bytes + nbytes
            progress(nbytes, len(batch))
    return {"documents": n_docs, "bytes": n_bytes}


def _groups(files, workers: int) -> list[list]:
    """Consecutive files in groups of about ``SHARD_BYTES`` (fewer bytes where that would
    leave under 4 groups per worker): a group is one shard, one worker's task."""
    sizes = [os.stat(f).st_size for f in files]
    target = max(1, min(SHARD_BYTES, sum(sizes) // (4 * workers)))
    groups, size = [[]], 0
    for f, n in zip(files, sizes):
        if groups[-1] and size + n > target:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += n
    return groups


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


def _shard(tmp: Path, i: int, name: str, dtype) -> np.ndarray:
    p = tmp / f"{i:06d}.{name}"
    return np.memmap(p, dtype, mode="r") if p.stat().st_size else np.zeros(0, dtype)


def _merge(tmp: Path, n_shards: int) -> tuple[int, int]:
    """Joins the shards into one ``.npy`` per field, copied shard by shard through
    memory maps (no field is ever whole in memory), and removes the shards."""
    lens = np.concatenate([np.fromfile(tmp / f"{i:06d}.lens", np.int64)
                           for i in range(n_shards)] + [np.zeros(0, np.int64)])
    total = int(lens.sum())
    np.save(tmp / "doc_starts.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    for field, name in (("tokens", "tokens.npy"), ("bytes", "token_bytes.npy")):
        out = np.lib.format.open_memmap(tmp / name, mode="w+", dtype=np.uint32, shape=(total, ))
        at = 0
        for i in range(n_shards):
            part = _shard(tmp, i, field, np.uint32)
            out[at:at + len(part)] = part
            at += len(part)
            del part
        out.flush()
        del out
    for i in range(n_shards):
        for n, _ in SHARD_FIELDS:
            (tmp / f"{i:06d}.{n}").unlink()
    return total, len(lens)


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
        workers = max(1, workers or min(len(files), os.cpu_count() or 1))
        groups = _groups(files, workers)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            parts = list(
                pool.map(
                    lambda a: _tokenize_files(a[0], a[1], tok, text_field, add_bos, add_eos, tmp,
                                              progress), enumerate(groups)))
        progress.close()
        n_tokens, n_docs = _merge(tmp, len(groups))
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
