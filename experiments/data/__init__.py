"""Language-modelling data with a deterministic order: the byte-level pydoc and synthetic
sources here; the documents of ``data.path`` through a tokenizer in ``experiments.data.pipeline``.

A corpus is one uint8 array split into a train part (the head) and a held-out part (the tail,
``heldout_fraction`` of it). The batch of training step ``s`` is ``B`` windows of ``S+1`` bytes
starting at offsets drawn by ``np.random.default_rng([seed, s])``: any process, any restart
computes the same batch for the same step, so a resumed run sees the batches an uninterrupted
one would. Evaluation uses fixed, evenly spaced windows of the held-out part.

Batches are numpy dicts of the GLOBAL batch: ``ids [B, S] int32`` (inputs), ``labels [B, S]
int32`` (the next bytes), ``weights [B, S] float32`` (1 = counts in the loss).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from configs.base import DataConfig
from experiments.data import pipeline

VOCAB_SIZE = 256  # byte values


def pydoc_corpus() -> bytes:
    """The standard library's pydoc topic help (English prose + code), in sorted topic order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def synthetic_corpus(num_bytes: int, seed: int) -> bytes:
    """An order-2 Markov chain over a 64-symbol printable alphabet with sparse random
    transitions (4 likely successors per context): learnable, with a known entropy floor."""
    rng = np.random.default_rng([seed, 0x5EED])
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .",
                             np.uint8)
    n = len(alphabet)
    succ = rng.integers(0, n, size=(n, n, 4))
    probs = rng.dirichlet(np.ones(4), size=(n, n))
    out = np.empty(num_bytes, np.int64)
    out[:2] = rng.integers(0, n, 2)
    u = rng.random(num_bytes)
    cum = np.cumsum(probs, axis=-1)
    for i in range(2, num_bytes):
        c = cum[out[i - 2], out[i - 1]]
        out[i] = succ[out[i - 2], out[i - 1], min(int(np.searchsorted(c, u[i])), 3)]
    return alphabet[out].tobytes()


@dataclasses.dataclass
class ByteDataset:
    """Train / held-out byte arrays and the deterministic batch functions."""

    config: DataConfig
    train: np.ndarray  # [N_train] uint8
    heldout: np.ndarray  # [N_heldout] uint8
    info: dict = dataclasses.field(default_factory=dict)  # what the startup line names

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def _windows(self, data: np.ndarray, starts: np.ndarray) -> dict:
        s = self.seq_len
        idx = starts[:, None] + np.arange(s + 1)[None, :]
        win = data[idx].astype(np.int32)  # [B, S+1]
        return {
            "ids": win[:, :-1],
            "labels": win[:, 1:],
            "weights": np.ones((len(starts), s), np.float32),
        }

    def train_batch(self, step: int, rows=None) -> dict:
        """Rows ``rows`` = (lo, hi) (default all) of the global batch of training step
        ``step`` (a function of (seed, step) only)."""
        rng = np.random.default_rng([self.config.seed, int(step)])
        starts = rng.integers(0, len(self.train) - self.seq_len - 1, size=self.batch_size)
        lo, hi = rows or (0, self.batch_size)
        return self._windows(self.train, starts[lo:hi])

    def eval_batches(self, num_batches: int) -> list[dict]:
        """``num_batches`` fixed global batches of evenly spaced held-out windows."""
        n = num_batches * self.batch_size
        last = len(self.heldout) - self.seq_len - 1
        starts = np.linspace(0, last, n).astype(np.int64)
        return [
            self._windows(self.heldout, starts[i * self.batch_size:(i + 1) * self.batch_size])
            for i in range(num_batches)
        ]


def load_dataset(config: DataConfig, tok=None, *, progress: bool = False):
    """Reads the corpus and splits it: the byte-level pydoc or synthetic source (a
    ``ByteDataset``), or the documents of ``data.path`` tokenized (``experiments.data.pipeline``'s
    ``TokenDataset``). Raises ValueError if either part is shorter than one example."""
    if config.resolved_source == "text":
        return pipeline.load_token_dataset(config, tok, progress=progress)
    if config.resolved_source == "pydoc":
        corpus = pydoc_corpus()
    else:
        corpus = synthetic_corpus(config.synthetic_bytes, config.seed)
    data = np.frombuffer(corpus, np.uint8)
    cut = int(round(len(data) * (1.0 - config.heldout_fraction)))
    train, heldout = data[:cut], data[cut:]
    need = config.seq_len + 2
    for part, arr in (("train", train), ("held-out", heldout)):
        if len(arr) < need:
            raise ValueError(
                f"the {config.resolved_source} corpus ({len(data)} bytes) leaves {len(arr)} bytes in the "
                f"{part} split (heldout_fraction={config.heldout_fraction}); one example needs "
                f"seq_len + 2 = {need}. Use a larger corpus or a smaller seq_len.")
    info = {
        "source": config.resolved_source,
        "files": 0,
        "documents": 1,
        "tokens": len(data),
        "bytes": len(data),
        "tokenizer": "bytes",
        "tokenizer_vocab": VOCAB_SIZE,
        "packing": "concat",
    }
    return ByteDataset(config=config, train=train, heldout=heldout, info=info)
