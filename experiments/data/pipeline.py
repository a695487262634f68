"""The tokenized dataset and the grain pipeline that feeds the training loop.

``load_token_dataset(config)`` reads the documents of ``data.path`` (``experiments.tokenizer.documents``),
tokenizes them once into the cache (``experiments.data.token_cache``) and splits the token stream:
the head for training, the tail (``heldout_fraction`` of the tokens) held out; a document the cut
falls in is split there.

The batch of training step ``s`` is a function of (seed, s) only, so any process, any restart
computes the same batch for the same step:
- ``concat``: B windows at offsets drawn by ``np.random.default_rng([seed, s])`` (as the
  byte-level data does);
- ``documents``: global rows ``s*B ... s*B + B-1`` of the packed rows shuffled by grain
  (``MapDataset.shuffle(seed)``, reshuffled every epoch, ``repeat``).

``train_batches`` is the grain pipeline of the loop: ``MapDataset.range(start, stop)`` mapped to
this process's rows of each step's batch (``process_rows``: the rows its devices hold in the
batch sharding, so a host reads only its part), read ahead by grain's prefetch threads, then put
on the devices as one global array (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import grain
import jax
import numpy as np

from configs.base import DataConfig
from experiments.tokenizer import documents
from experiments.data import packing, token_cache
from experiments.tokenizer import Tokenizer, load_tokenizer

HOST_ONLY = ("label_bytes", )  # batch fields the host keeps (bits per byte)
PREFETCH = 4


@dataclasses.dataclass
class TokenDataset:
    """Train / held-out token streams of a tokenized corpus and the batch functions."""

    config: DataConfig
    tokenizer: Tokenizer
    corpus: token_cache.TokenizedCorpus
    cut: int  # tokens [0, cut) train, [cut, N) held out
    info: dict  # what the startup line names

    def __post_init__(self):
        starts = np.asarray(self.corpus.doc_starts)
        inner = starts[(starts > 0) & (starts < self.cut)]
        self.train_docs = np.concatenate([[0], inner, [self.cut]])
        after = starts[(starts > self.cut) & (starts < len(self.corpus.tokens))] - self.cut
        self.heldout_docs = np.concatenate([[0], after, [len(self.corpus.tokens) - self.cut]])
        self.train_plan = self.heldout_plan = None
        if self.config.packing == "documents":
            self.train_plan = packing.plan_rows(self.train_docs, self.seq_len + 1)
            self.heldout_plan = packing.plan_rows(self.heldout_docs, self.seq_len + 1)
            self._rows = grain.MapDataset.range(
                self.train_plan.num_rows).shuffle(seed=self.config.seed).repeat()

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def _part(self, train: bool):
        t, b = self.corpus.tokens, self.corpus.token_bytes
        return (t[:self.cut], b[:self.cut]) if train else (t[self.cut:], b[self.cut:])

    def train_batch(self, step: int, rows=None) -> dict:
        """Rows ``rows`` = (lo, hi) (default all) of the global batch of training step
        ``step`` (a function of (seed, step) only)."""
        lo, hi = rows or (0, self.batch_size)
        tokens, nbytes = self._part(True)
        if self.train_plan is None:
            rng = np.random.default_rng([self.config.seed, int(step)])
            starts = rng.integers(0, len(tokens) - self.seq_len - 1, size=self.batch_size)
            return packing.windows(tokens, nbytes, starts[lo:hi], self.seq_len)
        first = int(step) * self.batch_size
        return packing.stack_rows([
            packing.document_row(self.train_plan, self._rows[first + j], tokens, nbytes,
                                 self.seq_len) for j in range(lo, hi)
        ])

    def eval_batches(self, num_batches: int) -> list[dict]:
        """``num_batches`` fixed global batches of evenly spaced held-out windows / rows."""
        n = num_batches * self.batch_size
        tokens, nbytes = self._part(False)
        if self.heldout_plan is None:
            starts = np.linspace(0, len(tokens) - self.seq_len - 1, n).astype(np.int64)
            rows = [
                packing.windows(tokens, nbytes, starts[i:i + 1], self.seq_len) for i in range(n)
            ]
            rows = [{k: v[0] for k, v in r.items()} for r in rows]
        else:
            idx = np.linspace(0, self.heldout_plan.num_rows - 1, n).astype(np.int64)
            rows = [
                packing.document_row(self.heldout_plan, int(r), tokens, nbytes, self.seq_len)
                for r in idx
            ]
        b = self.batch_size
        return [packing.stack_rows(rows[i * b:(i + 1) * b]) for i in range(num_batches)]


def _add_eos(config: DataConfig, tok: Tokenizer) -> bool:
    for field, tid in (("add_eos", tok.eos_id), ("add_bos", tok.bos_id)):
        if getattr(config, field) and tid is None:
            raise ValueError(f"data.{field}=True but the tokenizer {tok.name} has no "
                             f"{field[4:].upper()} token; leave data.{field} unset")
    return tok.eos_id is not None if config.add_eos is None else config.add_eos


def load_token_dataset(config: DataConfig,
                       tok: Tokenizer | None = None,
                       *,
                       progress: bool = True) -> TokenDataset:
    """The documents of ``config.path`` tokenized (cached) and split. Raises ValueError
    (DocumentError, TokenizerError) naming the problem; a cache entry this call built for a
    corpus it then refuses (too small to split) is removed."""
    tok = tok or load_tokenizer(config.tokenizer)
    files, skipped = documents.find_files(config.path)
    corpus = token_cache.build_or_load(files,
                                       tok,
                                       text_field=config.text_field,
                                       add_bos=config.add_bos,
                                       add_eos=_add_eos(config, tok),
                                       cache_dir=config.cache_dir,
                                       progress=progress)
    try:
        return _dataset(config, tok, corpus, skipped)
    except ValueError:
        if corpus.built:  # refused: the entry this call built is not left behind
            shutil.rmtree(corpus.path, ignore_errors=True)
        raise


def _dataset(config: DataConfig, tok: Tokenizer, corpus: token_cache.TokenizedCorpus,
             skipped: int) -> TokenDataset:
    """The dataset of a tokenized corpus, split; raises ValueError where it cannot train."""
    meta = corpus.meta
    n = len(corpus.tokens)
    if n and int(np.max(corpus.tokens)) >= tok.vocab_size:  # a cache that is not this tokenizer's
        raise ValueError(f"the tokenized cache {corpus.path} holds ids >= {tok.vocab_size}; "
                         "delete it")
    cut = int(round(n * (1.0 - config.heldout_fraction)))
    need = config.seq_len + 2
    for part, size in (("train", cut), ("held-out", n - cut)):
        if size < need:
            raise ValueError(f"data.path={config.path!r} ({meta['documents']} documents, "
                             f"{n} tokens of {tok.name}) leaves {size} tokens in the {part} split "
                             f"(heldout_fraction={config.heldout_fraction}); one example needs "
                             f"seq_len + 2 = {need}. Use a larger corpus or a smaller seq_len.")
    if n - cut < config.batch_size * (config.seq_len + 1):
        raise ValueError(f"data.path={config.path!r}: the held-out split ({n - cut} tokens, "
                         f"heldout_fraction={config.heldout_fraction}) is less than one batch of "
                         f"batch_size x (seq_len + 1) = {config.batch_size * (config.seq_len + 1)}"
                         " tokens; raise heldout_fraction or use a larger corpus")
    info = {
        "source": "text",
        "path": config.path,
        "files": meta["files"],
        "skipped_files": skipped,
        "documents": meta["documents"],
        "tokens": n,
        "bytes": meta["bytes"],
        "tokenizer": tok.name,
        "tokenizer_vocab": tok.vocab_size,
        "packing": config.packing,
        "cache": str(corpus.path) + (" (built)" if corpus.built else " (reused)"),
    }
    ds = TokenDataset(config=config, tokenizer=tok, corpus=corpus, cut=cut, info=info)
    if ds.heldout_plan is not None and ds.heldout_plan.num_rows < 1:
        raise ValueError(f"data.path={config.path!r}: the held-out split packs into no row")
    return ds


# ------------------------------------------------------------------------ the loop's feed


def process_rows(sharding, global_shape) -> tuple[int, int]:
    """(lo, hi): the rows of a global batch that this process's devices hold."""
    idx = sharding.addressable_devices_indices_map(tuple(global_shape)).values()
    los = [0 if i[0].start is None else i[0].start for i in idx]
    his = [global_shape[0] if i[0].stop is None else i[0].stop for i in idx]
    return min(los), max(his)


def put_local(local: dict, sharding, batch_size: int) -> dict:
    """This process's rows of a batch -> global jax arrays (host-only fields left out)."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size, ) + v.shape[1:])
        for k, v in local.items() if k not in HOST_ONLY
    }


def train_batches(dataset, start: int, stop: int, sharding):
    """The device batches of steps [start, stop): grain reads this process's rows of each
    step ahead of the step (``PREFETCH`` batches, in order)."""
    if stop <= start:
        return iter(())
    b = dataset.batch_size
    rows = process_rows(sharding, (b, dataset.seq_len))
    ds = grain.MapDataset.range(start, stop).map(lambda s: dataset.train_batch(int(s), rows))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=PREFETCH))
    return (put_local(local, sharding, b) for local in it)


def bits_per_byte(xents, batches) -> float:
    """Summed loss over the weighted held-out labels / the UTF-8 bytes they cover / ln 2
    (``xents``: each batch's mean loss per weighted label)."""
    nats = sum(float(x) * float(np.sum(b["weights"])) for x, b in zip(xents, batches))
    nbytes = sum(
        float(np.sum(b["label_bytes"] *
                     (b["weights"] > 0))) if "label_bytes" in b else float(np.sum(b["weights"]))
        for b in batches)
    return nats / max(nbytes, 1.0) / math.log(2)
