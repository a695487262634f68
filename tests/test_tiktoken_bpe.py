"""The tiktoken encoder of byte-level BPE tokenizer.json files (experiments.tiktoken_bpe) against
the `tokenizers` library's own encode: BPEs trained here (ByteLevel, and a Llama-3-style Split
regex with ignore_merges) on varied text, every document's ids compared; a tokenizer whose
vocabulary ids do not follow its merges and added tokens in the text (a wrong rank -> id table
fails these); tokenizers it must refuse; and the check of every piece tiktoken encodes against
the library's BPE that turns tiktoken off (one warning naming the piece) where its merges differ
from the library's, in the corpus's first text or late in a cache build (which then starts over
with the library)."""

import json
import logging
import unicodedata

import numpy as np
import pytest
import tokenizers
from pydoc_data import topics
from tokenizers import decoders, models, pre_tokenizers, trainers

from experiments import tiktoken_bpe, token_cache
from experiments import tokenizer as tokenizer_lib

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def _varied(rng, n: int) -> list[str]:
    """Documents of pydoc prose mixed with non-ASCII, emoji, numbers, whitespace runs and code."""
    keys = sorted(topics.topics)
    bits = [
        "Grüße, naïve café — 東京 ✓ Ελληνικά русский עברית العربية हिन्दी ", "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ",
        "3.14159 1,000,000 2026-12-02 0x1F 12345678901234 ", "   \t\t  \n\n\n    \r\n ",
        "def f(x):\n    return {'a': [1, 2]}  # it's\n", "I'm, you're, we'll, they'd, IT'S, He'S ",
        "e\u0301 combining, ﬁ ligature, \u200b zwsp ", "~~~~ ---- ==== **** ", "x" * 300 + " "
    ]
    docs = []
    for _ in range(n):
        parts = [topics.topics[keys[rng.integers(len(keys))]][:rng.integers(50, 3000)]]
        parts += [bits[i] for i in rng.integers(len(bits), size=rng.integers(1, 6))]
        rng.shuffle(parts)
        docs.append("".join(parts))
    return docs + ["", " ", "\n", "a", "😀", "   leading and trailing   "]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng()
    return _varied(rng, 60), _varied(rng, 120)  # training text, test text


def _train(texts, pre_tokenizer, out, vocab_size=1200) -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=vocab_size,
                            special_tokens=SPECIALS,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False))
    tok.save(str(out))
    return str(out)


def _edit(path, out, fn) -> str:
    spec = json.loads(open(path).read())
    fn(spec)
    out.write_text(json.dumps(spec))
    return str(out)


def _permute_ids(spec):
    """Vocabulary ids shuffled (added tokens keep theirs): no longer in merge or byte order."""
    vocab, added = spec["model"]["vocab"], {t["id"] for t in spec["added_tokens"]}
    free = [t for t, i in vocab.items() if i not in added]
    ids = np.random.default_rng().permutation([vocab[t] for t in free])
    vocab.update({t: int(i) for t, i in zip(free, ids)})


@pytest.fixture(scope="module")
def tokenizer_files(corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken_bpe")
    train, _ = corpus
    byte_level = _train(train, pre_tokenizers.ByteLevel(add_prefix_space=False), d / "bl.json")
    split = _train(
        train,
        pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        ]), d / "split.json")
    return {
        "byte_level":
        byte_level,
        "project_trainer":
        str(tokenizer_lib.train_tokenizer(train, "bpe", 800, d / "p.json").path),
        "split":
        split,
        "split_ignore_merges":
        _edit(split, d / "sim.json", lambda s: s["model"].update(ignore_merges=True)),
        "permuted_ids":
        _edit(byte_level, d / "perm.json", _permute_ids),
        "nfc":
        _edit(byte_level, d / "nfc.json", lambda s: s.update(normalizer={"type": "NFC"})),
    }


@pytest.mark.parametrize(
    "name",
    ["byte_level", "project_trainer", "split", "split_ignore_merges", "permuted_ids", "nfc"])
def test_every_documents_ids_are_the_librarys(tokenizer_files, corpus, name):
    tok = tokenizer_lib.load_tokenizer(tokenizer_files[name])
    lib = lambda t: tok.tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    _, texts = corpus
    specials = tok.tok.get_added_tokens_decoder().values()
    with_special = [
        f"{texts[i][:200]}{s.content}{texts[i + 1][:200]}" for i, s in enumerate(specials)
    ]
    texts = texts + with_special + ["e\u0301 not NFC"]
    fast, why = tiktoken_bpe.from_tokenizer_json(json.loads(tok.tok.to_str()))
    assert fast is not None, why
    # tiktoken alone: every document it keeps has the library's ids, covering all of its bytes
    ids, lens, library = fast.encode_batch(texts)
    ends = np.cumsum(lens)
    for d, text in enumerate(texts):
        if not library[d]:
            assert ids[ends[d] - lens[d]:ends[d]].tolist() == lib(text), (name, text[:80])
            assert int(tok.byte_len[ids[ends[d] - lens[d]:ends[d]]].sum()) == len(text.encode())
    n_special = len(with_special)
    has_special = [False] * (len(texts) - n_special - 1) + [True] * n_special + [False]
    changed = [name == "nfc" and not unicodedata.is_normalized("NFC", t) for t in texts]
    assert changed[-1] == (name == "nfc")
    assert library.tolist() == [a or b for a, b in zip(has_special, changed)]
    assert sum(library) < len(texts) / 2  # tiktoken encodes most of them
    # the cache's path: prepared on a sample, then every document (those tiktoken leaves too)
    tok.prepare(texts[:8])
    assert tok.fast is not None
    enc = tok.encode_batch(texts)
    ends = np.cumsum(enc.lens)
    for d, text in enumerate(texts):
        assert enc.ids[ends[d] - enc.lens[d]:ends[d]].tolist() == lib(text)
        assert int(enc.token_bytes[ends[d] - enc.lens[d]:ends[d]].sum()) == len(text.encode())
    # every piece was checked against the library's BPE, and none differed
    assert tok.fast is not None and tok.encoder_changes == 0
    assert "Grüße" in tok.fast.verified or " Grüße" in tok.fast.verified


def test_bytes_to_unicode_is_the_librarys_byte_level_alphabet():
    """Each byte's character as tokenizers' ByteLevel pre-tokenizer writes it, for every byte
    that UTF-8 text holds (all but 0xC0, 0xC1 and 0xF5-0xFF), and the same 256 characters."""
    text = "".join(map(chr, [*range(0x800), *range(0x800, 0x110000, 0x400)]))
    text = text.encode("utf-8", "ignore").decode()  # no surrogates
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                      use_regex=False).pre_tokenize_str(text)
    char_of = tiktoken_bpe.bytes_to_unicode()
    assert "".join(p for p, _ in pieces) == "".join(char_of[b] for b in text.encode())
    assert len(set(text.encode())) == 256 - 2 - 11
    assert sorted(char_of.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def _handmade(tmp_path, ignore_merges: bool, **spec_changes) -> tokenizer_lib.Tokenizer:
    """Bytes plus merges (b,c) -> bc, (a,b) -> ab, (ab,c) -> abc: BPE makes [a, bc] of "abc"."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update(bc=256, ab=257, abc=258)
    tok = tokenizers.Tokenizer(
        models.BPE(vocab, [("b", "c"), ("a", "b"), ("ab", "c")], ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    spec = json.loads(tok.to_str())
    spec.update(spec_changes)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tokenizer_lib.load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_refuses_what_tiktoken_would_encode_otherwise(tmp_path):
    # tiktoken takes a piece that is a token whole: "abc", which this BPE never makes
    tok = _handmade(tmp_path, ignore_merges=False)
    assert tok.encode("abc") == [tok.tok.token_to_id("a"), 256]
    fast, why = tiktoken_bpe.from_tokenizer_json(json.loads(tok.tok.to_str()))
    assert fast is None and "'abc' is not what BPE makes" in why
    # ...which is what ignore_merges=true does: accepted, and the same ids
    tok = _handmade(tmp_path, ignore_merges=True)
    fast, why = tiktoken_bpe.from_tokenizer_json(json.loads(tok.tok.to_str()))
    assert fast is not None, why
    dot = tok.tok.token_to_id(".")
    assert fast.encode_batch(["abc.abc"])[0].tolist() == tok.encode("abc.abc") == [258, dot, 258]
    bl = lambda **kw: {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
        **kw
    }
    split = lambda p: {
        "type": "Split",
        "pattern": {
            "Regex": p
        },
        "behavior": "Isolated",
        "invert": False
    }
    for changes, reason in [
        ({
            "normalizer": {
                "type": "Lowercase"
            }
        }, "normalizer Lowercase"),
        ({
            "pre_tokenizer": bl(add_prefix_space=True)
        }, "prefix space"),
        ({
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [split(r"\d"), split(r"\s"),
                                  bl(use_regex=False)]
            }
        }, "not Split(Regex) then ByteLevel"),
    ]:
        tok = _handmade(tmp_path, ignore_merges=True, **changes)
        fast, why = tiktoken_bpe.from_tokenizer_json(json.loads(tok.tok.to_str()))
        assert fast is None and reason in why, why
        tok.prepare(["abc"])
        assert tok.fast is None and tok.encode_batch(["abc 12"
                                                      ]).ids.tolist() == tok.encode("abc 12")


def _warning(tok, piece: str) -> str:
    """The warning of a piece ending in "abc": [..., a, bc] for tokenizers, [..., abc] tiktoken."""
    lib = tok.encode(piece)
    assert lib[-2:] == [tok.tok.token_to_id("a"), 256]
    return ("tokenizer.json: tokenizers encodes it from here on: tiktoken makes "
            f"{lib[:-2] + [258]} of {piece!r}, the library {lib}")


def test_prepare_keeps_the_library_where_the_first_text_differs(tmp_path, caplog):
    """tiktoken merges any two adjacent tokens that make a token ((a, bc) -> abc here),
    tokenizers only its merges' pairs: "xabc" is [x, abc] for one and [x, a, bc] for the other.
    Nothing in the tokenizer.json rules it out; the check of the first text's pieces finds it."""
    tok = _handmade(tmp_path, ignore_merges=True)
    tok.prepare(["abc yz"])
    assert tok.fast is not None  # the same ids here
    tok = _handmade(tmp_path, ignore_merges=True)
    assert tok.encode("xabc") == [tok.tok.token_to_id(c) for c in "xa"] + [256]
    with caplog.at_level(logging.WARNING):
        tok.prepare(["abc yz", "xabc"])
    assert tok.fast is None
    assert [r.getMessage() for r in caplog.records] == [_warning(tok, "xabc")]
    assert tok.encode_batch(["xabc"]).ids.tolist() == tok.encode("xabc")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_late_mismatch_rebuilds_the_cache_with_the_library(tmp_path, caplog, monkeypatch,
                                                             workers):
    """The piece whose ids differ (" xabc") first appears in the first file's second batch, past
    the text ``prepare`` checks (its first 256 documents, over 512K characters), after the
    second file's documents (workers=2) were encoded with tiktoken: the build turns tiktoken off
    there, says so once, and starts over; every document's ids are the library's."""
    monkeypatch.setattr(tiktoken_bpe, "MAX_VERIFIED", 50)  # the set of pieces starts over too
    rng = np.random.default_rng()
    words = ["yz", "ab", "bc", "cab", "x", "a", "bcb", "zab", "cc"]  # "abc" only at a piece's start
    docs = [" ".join(rng.choice(words, rng.integers(600, 900))) for _ in range(600)]
    late = int(rng.integers(token_cache.ENCODE_BATCH + 44, 450))
    docs[late] += " xabc"
    files = []
    for i, part in enumerate([docs[:450], docs[450:]]):
        files.append(tmp_path / f"{i}.jsonl")
        files[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    assert sum(map(len, docs[:token_cache.ENCODE_BATCH])) > token_cache.SAMPLE_CHARS
    tok = _handmade(tmp_path, ignore_merges=True)
    with caplog.at_level(logging.WARNING):
        c = token_cache.build_or_load(files,
                                      tok,
                                      cache_dir=tmp_path / "cache",
                                      progress=False,
                                      workers=workers)
    assert [r.getMessage() for r in caplog.records] == [_warning(tok, " xabc")]
    assert tok.fast is None and tok.encoder_changes == 1 and c.num_documents == len(docs)
    for d, text in enumerate(docs):
        assert c.tokens[c.doc_starts[d]:c.doc_starts[d + 1]].tolist() == tok.encode(text), d
        assert int(c.token_bytes[c.doc_starts[d]:c.doc_starts[d + 1]].sum()) == len(text)
