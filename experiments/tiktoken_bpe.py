"""Byte-level BPE ``tokenizer.json`` files (GPT-2, Llama 3, Qwen): each token's bytes, and a
faster encoder on tiktoken.

``token_byte_lengths(tok)`` is the table of the UTF-8 bytes each token stands for (the
denominator of bits per byte, read per id). ``tokenizers`` runs a byte-level BPE slower than
``tiktoken`` runs the same one, so the tokenized cache encodes with tiktoken where its ids are the
library's: proved from the file where its structure can, checked on the text where it cannot. The
``tiktoken.Encoding`` is built from the ``tokenizer.json``: each of the 256 bytes has rank = its
value, merge i's result rank 256 + i, and ``rank_to_id`` maps ranks to the tokenizer's own ids
(which need not follow the merges). ``from_tokenizer_json(spec)`` returns a
``TiktokenBPE``, or None and the reason where the tokenizer is not one tiktoken reproduces:

- model: BPE without dropout, ``continuing_subword_prefix``, ``end_of_word_suffix`` or
  ``byte_fallback``; every byte a token; every merge's result made by no earlier merge (tiktoken
  ranks a merged token, tokenizers a pair of tokens: one merge per token keeps the orders equal);
- tiktoken encodes a piece that is a token whole as that token, which is what
  ``ignore_merges=true`` does; with ``ignore_merges=false`` every token must be what the
  library's BPE makes of its own bytes (checked over the vocabulary), and with
  ``ignore_merges=true`` every token of the vocabulary must have a rank;
- normalizer: none, or NFC (a document that NFC changes goes to the library);
- pre-tokenizer: ``ByteLevel(use_regex=true)`` -> GPT-2's pattern, or
  ``Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]`` -> that regex; never a prefix
  space;
- added tokens (special or not) are tiktoken's special tokens, so a document holding one's text
  is found by its ranks and goes to the library (which also applies lstrip/rstrip/single_word).

A regex that leaves a gap between matches (tokenizers encodes the gap, tiktoken skips it) shows
as tokens whose bytes do not sum to the text; the caller sends such a document to the library.
What structure cannot prove is checked on the text. tiktoken merges any two adjacent tokens whose
concatenation is a token, tokenizers only the pairs of its merges (with merges (b, c), (a, b),
(ab, c) and a piece "xabc", tokenizers leaves [x, a, bc], tiktoken makes [x, abc]). Both run BPE
on each piece of the pre-tokenizer's split alone, so ``TiktokenBPE.encode_batch`` checks every
distinct piece of the documents it encodes against the library's BPE model the first time it
meets it (``verify``: split with the same pattern by ``regex``, as tiktoken's
``_encode_only_native_bpe`` does; the pieces checked are kept, up to ``MAX_VERIFIED``) and raises
``Mismatch`` where one differs; the tokenizer then encodes with the library, says so once (the
piece and both id lists), and a cache build starts over. What is left to a sample is the split
itself (three regex engines, their Unicode tables): the corpus's first documents are encoded
whole both ways before a cache build (``HuggingFaceTokenizer.prepare``). The check costs one more
regex pass over the text (in Python, one thread at a time) and the library's BPE on each new
piece.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import threading
import unicodedata
from typing import Optional

import numpy as np
import regex
import tiktoken
import tokenizers

# tokenizers' ByteLevel pre-tokenizer with use_regex=true splits with this (GPT-2's) pattern
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# pieces remembered as verified; past it the set starts empty again (re-verifying the frequent
# pieces once more costs little; memory stays bounded: ~100 bytes a piece)
MAX_VERIFIED = 1 << 22


class Mismatch(ValueError):
    """tiktoken's ids of a piece are not the library's (the message names both)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the character that stands for it in a byte-level token."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def token_byte_lengths(tok: tokenizers.Tokenizer) -> Optional[np.ndarray]:
    """[vocab] the bytes each token stands for, where the tokenizer is byte-level (its decoder
    ByteLevel, every token's characters in the ByteLevel alphabet of 256, one per byte); added
    tokens 0. None otherwise."""
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    types = [d.get("type") for d in decoder.get("decoders", [decoder])]
    if "ByteLevel" not in types:
        return None
    alphabet = set(bytes_to_unicode().values())
    table = np.zeros(tok.get_vocab_size(with_added_tokens=True), np.uint32)
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        if not alphabet.issuperset(token):
            return None
        table[i] = len(token)
    table[list(tok.get_added_tokens_decoder())] = 0
    return table


class TiktokenBPE:
    """A ``tiktoken.Encoding``, the table from its ranks to the tokenizer's ids, and the library's
    BPE model alone (``model``: no normalizer, pre-tokenizer or added tokens) that every piece
    tiktoken encodes is checked against."""

    def __init__(self, encoding: tiktoken.Encoding, rank_to_id: np.ndarray, n_ordinary: int,
                 nfc: bool, model: tokenizers.Tokenizer):
        self.encoding = encoding
        self.rank_to_id = rank_to_id  # [ranks] uint32: the ordinary ranks, then the added tokens'
        self.n_ordinary = n_ordinary  # ranks at or above it are added tokens
        self.nfc = nfc  # the tokenizer's normalizer is NFC
        self.model = model
        self.threads = os.cpu_count() or 1
        self.splitter = regex.compile(encoding._pat_str)
        self.byte_chars = "".join(bytes_to_unicode()[b] for b in range(256))
        self.verified: set[str] = set()  # pieces whose ids are the library's
        self.lock = threading.Lock()

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [N] uint32 of every document one after another, lens [D] int64, library [D] bool:
        the documents whose ids are not the library's here: an added token's text is in them,
        or NFC changes them). tiktoken encodes outside the GIL, on ``threads`` threads. Raises
        Mismatch where a piece of a document it keeps has other ids than the library's
        (``verify``)."""
        if self.encoding.special_tokens_set:
            out = self.encoding.encode_batch(texts, num_threads=self.threads, allowed_special="all")
        else:
            out = self.encoding.encode_ordinary_batch(texts, num_threads=self.threads)
        lens = np.fromiter(map(len, out), np.int64, len(out))
        ranks = np.fromiter(itertools.chain.from_iterable(out), np.uint32, int(lens.sum()))
        library = np.zeros(len(texts), bool)
        if len(self.rank_to_id) > self.n_ordinary and len(ranks):
            added = np.concatenate([[0], np.cumsum(ranks >= self.n_ordinary)])
            ends = np.cumsum(lens)
            library |= added[ends] > added[ends - lens]
        if self.nfc:
            library |= np.fromiter((not unicodedata.is_normalized("NFC", t) for t in texts), bool,
                                   len(texts))
        self.verify(itertools.compress(texts, ~library))
        return self.rank_to_id[ranks], lens, library

    def verify(self, texts) -> None:
        """Raises Mismatch unless tiktoken's ids of each piece the pattern splits ``texts`` into
        are the library's BPE model's ids of that piece (its characters mapped byte by byte, as
        ByteLevel does), for the pieces not verified before. tiktoken and tokenizers both run BPE
        on each piece alone, so a text all of whose pieces agree has the library's ids (given
        that the three regex engines - tiktoken's, tokenizers' and ``regex`` here - split it
        alike)."""
        with self.lock:  # one thread at a time: two splitting at once are slower than one
            pieces = set(itertools.chain.from_iterable(map(self.splitter.findall, texts)))
            new = list(pieces - self.verified - {""})
            if not new:
                return
            ours = [self.encoding._encode_single_piece(p) for p in new]
            words = [p.encode().decode("latin-1").translate(self.byte_chars) for p in new]
            # each word alone through BPE; 4096 words a sequence (a call per word costs more)
            encs = self.model.encode_batch_fast(
                [words[i:i + 4096] for i in range(0, len(new), 4096)],
                is_pretokenized=True,
                add_special_tokens=False)
            theirs = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), np.int64)
            # the same tokens one after another are the same tokens per piece: a piece ends at
            # the same byte offset in both
            if not np.array_equal(self.rank_to_id[np.fromiter(itertools.chain(*ours), np.int64)],
                                  theirs):
                for p, r, w in zip(new, ours, words):
                    ids = self.rank_to_id[r].tolist()
                    lib = self.model.encode([w], is_pretokenized=True, add_special_tokens=False).ids
                    if ids != lib:
                        raise Mismatch(f"tiktoken makes {ids} of {p!r}, the library {lib}")
                raise Mismatch(f"tiktoken's ids of {len(new)} pieces are not the library's")
            if len(self.verified) + len(new) > MAX_VERIFIED:
                self.verified.clear()
            self.verified.update(new)


def _pattern(pre: Optional[dict]) -> tuple[Optional[str], str]:
    """The regex tiktoken splits with for pre-tokenizer ``pre`` (None and why where none)."""
    seq = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre]
    if not seq or seq[-1] is None or seq[-1].get("type") != "ByteLevel":
        return None, "the pre-tokenizer does not end in ByteLevel"
    byte_level = seq[-1]
    if byte_level.get("add_prefix_space"):
        return None, "ByteLevel adds a prefix space"
    if len(seq) == 1:
        if not byte_level.get("use_regex", True):
            return None, "ByteLevel without its regex and no Split before it"
        return GPT2_PATTERN, ""
    split = seq[0]
    if len(seq) != 2 or split.get("type") != "Split" or byte_level.get("use_regex", True):
        return None, "the pre-tokenizer is not Split(Regex) then ByteLevel(use_regex=false)"
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return None, f"Split with behavior {split.get('behavior')}, invert {split.get('invert')}"
    if "Regex" not in (split.get("pattern") or {}):
        return None, "Split by a string, not a regex"
    return split["pattern"]["Regex"], ""


def _bare_model(spec: dict) -> tokenizers.Tokenizer:
    """The library's BPE model of ``spec`` alone: a pre-tokenized word of byte-level characters
    goes to its BPE whole."""
    bare = copy.deepcopy(spec)
    for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding"):
        bare[k] = None
    bare["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(bare))


def _unreachable(model: tokenizers.Tokenizer, tokens: list[str], ids: list[int]) -> list[str]:
    """The tokens that the library's BPE model alone does not encode as themselves."""
    encs = model.encode_batch_fast([[t] for t in tokens],
                                   is_pretokenized=True,
                                   add_special_tokens=False)
    return [t for t, i, e in zip(tokens, ids, encs) if e.ids != [i]]


def from_tokenizer_json(spec: dict) -> tuple[Optional[TiktokenBPE], str]:
    """``spec``: a parsed ``tokenizer.json``. (TiktokenBPE, "") where tiktoken gives its ids
    (the module docstring says when), else (None, the reason)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')}, not BPE"
    for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(k):
            return None, f"BPE with {k}={model[k]!r}"
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        return None, f"normalizer {normalizer}"
    pattern, why = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, why
    char_of = bytes_to_unicode()
    char_byte = {c: b for b, c in char_of.items()}
    vocab = model.get("vocab") or {}
    ranks = {bytes([b]): b for b in range(256)}
    id_of_rank = [vocab.get(char_of[b]) for b in range(256)]
    if None in id_of_rank:
        return None, "a byte is not a token"
    merged_tokens = []
    for i, m in enumerate(model.get("merges") or []):
        left, right = m.split(" ") if isinstance(m, str) else m
        merged = left + right
        if merged not in vocab or not char_byte.keys() >= set(merged):
            return None, f"merge {i} makes {merged!r}, not a byte-level token"
        bts = bytes(char_byte[c] for c in merged)
        if bts in ranks:
            return None, f"merge {i} makes {merged!r}, which an earlier merge made"
        ranks[bts] = 256 + i
        id_of_rank.append(vocab[merged])
        merged_tokens.append(merged)
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    bare = _bare_model(spec)
    if model.get("ignore_merges"):
        ranked = set(id_of_rank)
        missing = [t for t, i in vocab.items() if i not in ranked and t not in added]
        if missing:
            return None, f"ignore_merges and token {missing[0]!r} is made by no merge"
    else:
        bad = _unreachable(bare, merged_tokens, id_of_rank[256:])
        if bad:
            return None, f"token {bad[0]!r} is not what BPE makes of its bytes (ignore_merges=false)"
    n = len(ranks)
    specials = {c: n + j for j, c in enumerate(added)}
    try:
        enc = tiktoken.Encoding("tokenizer.json",
                                pat_str=pattern,
                                mergeable_ranks=ranks,
                                special_tokens=specials)
    except ValueError as e:  # a regex tiktoken's engine does not compile
        return None, f"tiktoken refuses it ({' '.join(str(e).split())[:120]})"
    rank_to_id = np.asarray(id_of_rank + list(added.values()), np.uint32)
    return TiktokenBPE(enc, rank_to_id, n, normalizer == "NFC", bare), ""
