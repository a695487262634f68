r"""Tokenizers: bytes, a SentencePiece ``.model`` file, a Hugging Face ``tokenizer.json``.

``load_tokenizer(spec)`` takes ``"bytes"`` (the 256 byte values; no BOS or EOS), a path to a
SentencePiece model (the ``sentencepiece`` package), or a path to a Hugging Face
``tokenizer.json`` or a directory holding one (the ``tokenizers`` package). Every tokenizer has
``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``bos_id`` / ``eos_id``
(None where it has none), ``name``, ``path`` (None for bytes), ``sha256`` (of its file) and
``engine`` (the library that encodes: ``bytes``, ``sentencepiece``, ``tiktoken``, ``tokenizers``).
``encode_with_bytes`` also returns, per token, the UTF-8 bytes of ``text`` it covers (they sum
to ``len(text.encode())``): the denominator of bits per byte. ``encode_batch(texts)`` encodes
many documents in one library call into flat arrays (``EncodedBatch``), the tokenized cache's
input; for a SentencePiece model and a byte-level BPE ``tokenizer.json`` (GPT-2, Llama 3,
Qwen, DeepSeek) it asks the library for ids only and reads each token's bytes from a table of
the vocabulary (``_table_batch``; the offsets only for a document whose bytes do not add up).

A byte-level BPE ``tokenizer.json`` is encoded by ``tiktoken`` (several times faster) where it
gives exactly the ids of ``tokenizers`` (``experiments.tokenizer.bpe_tiktoken``: a structural check of
the file and a probe, at load); otherwise by ``tokenizers``, with one line on stderr saying
why. ``engine`` names the library; ``encode``, ``encode_with_bytes`` and ``encode_batch`` all
use it, so training, eval and sampling tokenize alike.

A job directory keeps the copy it trained with (``experiments.tokenizer.job_copy``: the file and
its hash); ``job_copy.job_tokenizer(job_log_dir)`` loads it.

Training one on the documents a run reads: ``python -m experiments.tokenizer``
(``experiments.tokenizer.train``). A SentencePiece
model that does not round-trip text (``dropped_by``: newlines, tabs, runs of spaces, as
SentencePiece's default normalization drops them) is loaded with a one-line warning naming
what it drops.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import sentencepiece as spm
import tokenizers
from tokenizers import pre_tokenizers

from experiments.tokenizer import bpe_tiktoken

BYTES = "bytes"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or trained (one line, exit status 2)."""


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _ends_to_counts(ends: np.ndarray, total: int) -> np.ndarray:
    """Per-token byte counts from each token's end offset (bytes between tokens go to the token
    after them, the tail to the last token): they sum to ``total``."""
    if len(ends) == 0:
        return np.zeros(0, np.int64)
    ends = np.maximum.accumulate(np.minimum(np.asarray(ends, np.int64), total))
    ends[-1] = total
    return np.diff(ends, prepend=0)


def _char_to_byte_offsets(text: str) -> Optional[np.ndarray]:
    """[len(text) + 1] byte offset of each character (None for ASCII text: the same)."""
    if text.isascii():
        return None
    cps = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    width = 1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000)
    return np.concatenate([[0], np.cumsum(width)])


class EncodedBatch(NamedTuple):
    """Documents encoded one after another."""

    ids: np.ndarray  # [N] uint32
    token_bytes: np.ndarray  # [N] uint32: the UTF-8 bytes of text each id covers
    lens: np.ndarray  # [D] int64: the ids of each document


def _flat(pairs) -> EncodedBatch:
    """[(ids, bytes) per document] -> EncodedBatch."""
    ids, nbytes = [p[0] for p in pairs], [p[1] for p in pairs]
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    cat = lambda xs: np.concatenate(xs).astype(np.uint32) if xs else np.zeros(0, np.uint32
                                                                              )  # noqa: E731
    return EncodedBatch(cat(ids), cat(nbytes), lens)


def _table_batch(texts, ids, table: np.ndarray, offsets_bytes) -> EncodedBatch:
    """Documents encoded as ``ids`` (a list per document), each token's bytes read from
    ``table`` [vocab] (what the token stands for in the text); a document whose bytes do not sum
    to its text (an added token matched in the text, a normalizer that changed it) takes its
    bytes from ``offsets_bytes(text)`` (the library's offsets)."""
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    ids = np.concatenate([np.zeros(0, np.uint32), *ids]).astype(np.uint32, copy=False) \
        if ids and isinstance(ids[0], np.ndarray) else \
        np.fromiter(itertools.chain.from_iterable(ids), np.uint32, int(lens.sum()))
    nbytes = table[ids]
    ends = np.cumsum(lens)
    summed = np.concatenate([[0], np.cumsum(nbytes, dtype=np.int64)])
    want = np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
    for d in np.flatnonzero(summed[ends] - summed[ends - lens] != want):
        nbytes[ends[d] - lens[d]:ends[d]] = offsets_bytes(texts[d])
    return EncodedBatch(ids, nbytes, lens)


# what a lossless tokenizer keeps: decode(encode(probe)) == probe for each
LOSSLESS_PROBES = {
    "newlines": "a\nb\n\nc\n",
    "tabs": "a\tb\t\tc",
    "runs of spaces": "a  b    c",
    "leading spaces": "  a",
    "trailing spaces": "a  ",
}
_warned: set = set()  # the tokenizer files already warned about


def dropped_by(tok) -> list[str]:
    """What ``tok`` loses in decode(encode(text)): the names of ``LOSSLESS_PROBES`` it does
    not round-trip (empty for a lossless tokenizer)."""
    return [k for k, probe in LOSSLESS_PROBES.items() if tok.decode(tok.encode(probe)) != probe]


class Tokenizer:
    """What every tokenizer offers (see the module docstring)."""

    name: str
    engine: str
    path: Optional[Path] = None
    sha256: Optional[str] = None
    vocab_size: int
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, bytes covered by each id) of ``text``."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> EncodedBatch:
        return _flat([self.encode_with_bytes(t) for t in texts])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, vocab {self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text, ids 0-255 (today's byte-level runs)."""

    name = engine = BYTES
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_bytes(self, text):
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return ids, np.ones(len(ids), np.int64)

    def encode_batch(self, texts):
        data = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"".join(data), np.uint8).astype(np.uint32)
        return EncodedBatch(ids, np.ones(len(ids), np.uint32),
                            np.fromiter(map(len, data), np.int64, len(data)))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    engine = "sentencepiece"

    def __init__(self, path: Path):
        self.path, self.name = path, path.name
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"data.tokenizer={str(path)!r} does not load as a SentencePiece "
                                 f"model ({' '.join(str(e).split())[:160]}); give a .model file "
                                 "that spm_train or `python -m experiments.tokenizer` wrote") from e
        self.vocab_size = self.sp.GetPieceSize()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.piece_bytes = self._piece_bytes()
        dropped = dropped_by(self)
        if dropped and str(path) not in _warned:
            _warned.add(str(path))
            print(
                f"experiments.tokenizer: warning: the SentencePiece model {path} does not "
                f"round-trip text: decode(encode(text)) drops or changes {', '.join(dropped)}, "
                "so a model trained with it cannot write them; `python -m "
                "experiments.tokenizer --kind sentencepiece` trains one that keeps them",
                file=sys.stderr,
                flush=True)

    def _piece_bytes(self) -> np.ndarray:
        """[vocab] the bytes of text each piece stands for: a byte piece 1, a control or
        unknown piece 0, any other its text with U+2581 as a space (right where the model does
        not normalize the text; ``_table_batch`` checks each document's sum)."""
        sp = self.sp
        return np.fromiter((1 if sp.IsByte(i) else 0 if sp.IsControl(i) or sp.IsUnknown(i) else len(
            sp.IdToPiece(i).replace("\u2581", " ").encode("utf-8"))
                            for i in range(self.vocab_size)), np.uint32, self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    @staticmethod
    def _with_bytes(text, proto):
        ids = np.fromiter((p.id for p in proto.pieces), np.int32)
        ends = np.fromiter((p.end for p in proto.pieces), np.int64)
        return ids, _ends_to_counts(ends, len(text.encode("utf-8")))

    def encode_with_bytes(self, text):
        enc = self.encode_batch([text])
        return enc.ids.astype(np.int32), enc.token_bytes.astype(np.int64)

    def encode_batch(self, texts):
        """Ids only from the library (over the cores), each token's bytes from
        ``piece_bytes``; a document where they do not sum to its text (a normalizing model)
        takes them from the pieces' offsets."""
        ids = self.sp.encode(texts, out_type=int, num_threads=os.cpu_count() or 1)
        return _table_batch(texts, ids, self.piece_bytes,
                            lambda t: self._with_bytes(t, self.sp.encode(t, out_type="proto"))[1])

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):

    def __init__(self, path: Path):
        self.path, self.name = path, path.name
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception type for a bad file
            raise TokenizerError(f"data.tokenizer={str(path)!r} does not load as a Hugging Face "
                                 f"tokenizer.json ({' '.join(str(e).split())[:160]}); give a "
                                 "tokenizer.json that `tokenizers` or `python -m "
                                 "experiments.tokenizer` wrote") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"))
        self.eos_id = self._special(("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"))
        spec = json.loads(self.tok.to_str())
        self.byte_len = self._byte_level_lengths(spec)
        self.tiktoken, why = (None, "not byte-level") if self.byte_len is None else \
            bpe_tiktoken.tiktoken_encoding(spec, self.tok, path.name)
        self.engine = "tokenizers" if self.tiktoken is None else "tiktoken"
        if self.tiktoken is not None:  # every id its bytes, an added token matched in the text too
            self.tiktoken_len = self.byte_len.copy()
            for i, token in self.tok.get_added_tokens_decoder().items():
                self.tiktoken_len[i] = len(token.content.encode("utf-8"))
        elif str(path) not in _warned:
            _warned.add(str(path))
            print(f"experiments.tokenizer: {path} is encoded by tokenizers, not tiktoken: {why}",
                  file=sys.stderr,
                  flush=True)

    def _byte_level_lengths(self, spec: dict) -> Optional[np.ndarray]:
        """[vocab] the bytes each token stands for, where the tokenizer (``spec``, its parsed
        tokenizer.json) is byte-level (its decoder ByteLevel, every token's characters in the
        ByteLevel alphabet of 256, one per byte); added tokens 0. None otherwise."""
        decoder = spec.get("decoder") or {}
        types = [d.get("type") for d in decoder.get("decoders", [decoder])]
        if "ByteLevel" not in types:
            return None
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        table = np.zeros(self.vocab_size, np.uint32)
        for token, i in self.tok.get_vocab(with_added_tokens=False).items():
            if not alphabet.issuperset(token):
                return None
            table[i] = len(token)
        table[list(self.tok.get_added_tokens_decoder())] = 0
        return table

    def _special(self, names) -> Optional[int]:
        for n in names:
            i = self.tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        if self.tiktoken is not None:
            return bpe_tiktoken.encode(self.tiktoken, text).tolist()
        return self.tok.encode(text, add_special_tokens=False).ids

    def _with_bytes(self, text, enc):
        ids = np.asarray(enc.ids, np.int32)
        ends = np.fromiter((e for _, e in enc.offsets), np.int64, len(ids))
        char_bytes = _char_to_byte_offsets(text)
        if char_bytes is not None:
            ends = char_bytes[np.minimum(ends, len(text))]
        return ids, _ends_to_counts(ends, len(text.encode("utf-8")))

    def encode_with_bytes(self, text):
        enc = self.encode_batch([text])
        return enc.ids.astype(np.int32), enc.token_bytes.astype(np.int64)

    def encode_batch(self, texts):
        """tiktoken (where it encodes as ``tokenizers`` does, ``experiments.tokenizer.bpe_tiktoken``):
        its ids, each token's bytes from ``tiktoken_len``. Other byte-level ones: ids only from
        ``tokenizers`` (no offsets), each token's bytes from ``byte_len`` (``_table_batch``).
        Otherwise the offsets of every document."""
        if self.tiktoken is not None:
            enc = self.tiktoken
            ids = [bpe_tiktoken.encode(enc, t) for t in texts]
            return _table_batch(texts, ids, self.tiktoken_len,
                                lambda t: [len(b) for b in enc.decode_tokens_bytes(self.encode(t))])
        if self.byte_len is None:
            encs = self.tok.encode_batch(texts, add_special_tokens=False)
            return _flat([self._with_bytes(t, e) for t, e in zip(texts, encs)])
        ids = [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]
        return _table_batch(
            texts, ids, self.byte_len,
            lambda t: self._with_bytes(t, self.tok.encode(t, add_special_tokens=False))[1])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_file(spec: str) -> Optional[Path]:
    """The file a tokenizer spec names (None for bytes); raises TokenizerError if missing."""
    if spec == BYTES:
        return None
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"data.tokenizer={spec!r}: no such file; give 'bytes', a "
                             "SentencePiece .model file, or a Hugging Face tokenizer.json (or a "
                             "directory holding one)")
    return p.absolute()


def load_tokenizer(spec: str) -> Tokenizer:
    """'bytes' or a path (see the module docstring). Raises TokenizerError (one line)."""
    if not isinstance(spec, str) or not spec:
        raise TokenizerError(f"data.tokenizer={spec!r} is invalid: 'bytes' or a tokenizer file")
    p = tokenizer_file(spec)
    if p is None:
        return ByteTokenizer()
    with open(p, "rb") as f:
        head = f.read(1).lstrip()
    tok = HuggingFaceTokenizer(p) if head == b"{" else SentencePieceTokenizer(p)
    tok.sha256 = file_sha256(p)
    return tok
