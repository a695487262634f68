"""tiktoken as the encoder of byte-level BPE tokenizer.json files (experiments.tokenizer.bpe_tiktoken): it
serves a file only where it gives the ids of the ``tokenizers`` library, checked here on fresh
random text and on this repository's own .py and .md files, for a BPE trained here, one with a
``Split`` regex before ByteLevel (Qwen2 / Llama 3 style) and the Hugging Face fixtures; files it
cannot serve exactly (a normalizer, ranks out of merge order, a token its merges do not make the
way tiktoken would) fall back to ``tokenizers`` with one line saying why."""

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from experiments.tokenizer import bpe_tiktoken
from experiments import tokenizer as tokenizer_lib
from tests import testutil

REPO = Path(__file__).resolve().parents[1]
FIXTURES = sorted((REPO / "tests" / "fixtures" / "hf").glob("*/tokenizer.json"))
# Qwen2's pre-tokenizer regex (a Split before a ByteLevel without its own regex)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# code points random text is drawn from: ASCII, whitespace, Latin-1, combining marks, Greek,
# Cyrillic, Hebrew, Arabic, Devanagari, CJK, Hangul, emoji, symbols, the zero-width joiner
RANGES = [(0x20, 0x7E), (0x09, 0x0A), (0x0D, 0x0D), (0xA0, 0xFF), (0x300, 0x36F), (0x391, 0x3C9),
          (0x410, 0x44F), (0x5D0, 0x5EA), (0x627, 0x64A), (0x905, 0x939), (0x4E00, 0x4FFF),
          (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x2200, 0x22FF), (0x200D, 0x200D)]


def _random_texts(rng, n: int) -> list[str]:
    """Documents of random runs: words of one script, whitespace runs, digits, punctuation."""
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.integers(1, 60)):
            lo, hi = RANGES[rng.integers(len(RANGES))]
            cps = rng.integers(lo, hi + 1, rng.integers(1, 12))
            sep = rng.choice([" ", "  ", "\n", "\t", " \n ", "", "'s ", "'LL ", "\r\n", "   "])
            parts.append("".join(map(chr, cps)) + sep)
        out.append("".join(parts))
    return out


def _repo_texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in testutil.repo_files({".py", ".md"})]


def _train(path: Path, texts, pre_tokenizer, vocab_size=1200) -> Path:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """BPE tokenizer.json files trained on a random half of the repository's files."""
    d = tmp_path_factory.mktemp("bpe")
    texts = _repo_texts()
    rng = np.random.default_rng()
    texts = [texts[i] for i in rng.permutation(len(texts))[:len(texts) // 2]]
    return {
        "byte_level":
        _train(d / "byte_level.json", texts, pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "split_regex":
        _train(
            d / "split_regex.json", texts,
            pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            ])),
    }


def _assert_same_ids(tok, texts):
    """tok's encode / encode_batch (tiktoken) equal the tokenizers library's ids, and each
    token's bytes are its bytes of the text."""
    assert tok.engine == "tiktoken"
    enc = tok.encode_batch(texts)
    ref = [e.ids for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False)]
    got = np.split(enc.ids, np.cumsum(enc.lens)[:-1]) if texts else []
    bad = [d for d, (g, r) in enumerate(zip(got, ref)) if g.tolist() != r]
    assert len(got) == len(texts) and not bad, \
        f"{len(bad)} of {len(texts)} texts differ, e.g. {texts[bad[0]][:200]!r}"
    ends = np.cumsum(enc.lens)
    for d, text in enumerate(texts):
        nb = enc.token_bytes[ends[d] - enc.lens[d]:ends[d]]
        pieces = tok.tiktoken.decode_tokens_bytes(enc.ids[ends[d] - enc.lens[d]:ends[d]].tolist())
        assert b"".join(pieces) == text.encode("utf-8")
        np.testing.assert_array_equal(nb, [len(p) for p in pieces])


@pytest.mark.parametrize("name", ["byte_level", "split_regex"])
def test_trained_bpe_is_encoded_by_tiktoken_with_tokenizers_ids_on_random_text(trained, name):
    tok = tokenizer_lib.load_tokenizer(str(trained[name]))
    texts = _random_texts(np.random.default_rng(), 200)
    texts += ["", " ", "<s>a</s>", "x<|im_start|>y<s><s>", "<|im_start", "'S'll\r\n\r\n  \t"]
    _assert_same_ids(tok, texts)
    ids, nb = tok.encode_with_bytes(texts[0])
    assert ids.tolist() == tok.encode(texts[0]) == tok.tok.encode(texts[0],
                                                                  add_special_tokens=False).ids
    assert int(nb.sum()) == len(texts[0].encode("utf-8"))


@pytest.mark.slow  # the fixtures' three tokenizer.json files are one file, so one of them
@pytest.mark.parametrize("name", ["byte_level", "split_regex", FIXTURES[0].parent.name])
def test_tiktoken_gives_tokenizers_ids_on_the_repositorys_files(trained, name):
    path = trained.get(name) or REPO / "tests" / "fixtures" / "hf" / name / "tokenizer.json"
    _assert_same_ids(tokenizer_lib.load_tokenizer(str(path)), _repo_texts())


def _edited(src: Path, dst: Path, edit) -> str:
    spec = json.loads(src.read_text())
    edit(spec)
    dst.write_text(json.dumps(spec))
    return str(dst)


def _swap_two_merges(spec):
    """The tokens of merges 10 and 20 swap ids: the ranks no longer follow the merges."""
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    a, b = ("".join(m.split(" ") if isinstance(m, str) else m) for m in (merges[10], merges[20]))
    vocab[a], vocab[b] = vocab[b], vocab[a]


@pytest.mark.parametrize("edit, why", [
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "a normalizer"),
    (lambda s: s.update(normalizer={"type": "NFKC"}), "a normalizer"),
    (_swap_two_merges, "not above the earlier merge's"),
    (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer"),
    (lambda s: s["added_tokens"][1].update(lstrip=True), "strips"),
])
def test_a_file_tiktoken_cannot_serve_exactly_falls_back_with_one_line(
        trained, tmp_path, capsys, edit, why):
    path = _edited(trained["byte_level"], tmp_path / "tokenizer.json", edit)
    tok = tokenizer_lib.load_tokenizer(path)
    assert tok.engine == "tokenizers" and tok.tiktoken is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and path in err[0], err
    text = _random_texts(np.random.default_rng(), 1)[0] + " Hello <s>"
    ref = tok.tok.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == ref and tok.encode_batch([text]).ids.tolist() == ref


def test_merges_tiktoken_would_reorder_fail_the_probe(tmp_path, capsys):
    """'abc' made as (ab, c), but 'bc' merges first: tokenizers encodes 'abc' as [a, bc] (no
    rule joins them), tiktoken as [abc] (a token whole, and a+bc concatenates to it). The
    structure passes; the check of the vocabulary's tokens catches it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert bpe_tiktoken.ineligible(spec) == ""
    spec["model"]["dropout"] = 0.1  # random merges: never tiktoken's
    assert "dropout" in bpe_tiktoken.ineligible(spec)
    assert tok.encode("abc").tokens == ["a", "bc"]
    loaded = tokenizer_lib.load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.engine == "tokenizers"
    assert "tokens, encoded alone by the merges, are not themselves (e.g. 'abc')" in \
        capsys.readouterr().err
    assert loaded.encode("abc abc") == tok.encode("abc abc").ids
