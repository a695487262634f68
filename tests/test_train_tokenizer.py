"""`python -m experiments.tokenizer`: lossless SentencePiece models trained on whole
documents (newlines, tabs and runs of spaces kept), the chunks its trainer reads, the warning
for a loaded SentencePiece model that drops whitespace, and the command line (progress, what it
read, sampling of large corpora, bad input as one line)."""

import io
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from pydoc_data import topics

import numpy as np
import pytest
import sentencepiece as spm

from experiments import tokenizer as tokenizer_lib
from experiments.tokenizer import train as train_lib


def _code_like(rng: random.Random, n: int) -> list[str]:
    """Documents of indented lines, tabs, blank lines and runs of spaces, drawn fresh."""
    words = ["def", "return", "x", "self", "if", "else:", "for", "in", "range(10):", "#", "a"]
    docs = []
    for _ in range(n):
        lines = []
        for _ in range(rng.randint(3, 30)):
            indent = rng.choice(["", "    ", "        ", "\t", "\t\t", "  "])
            gap = rng.choice([" ", "  ", "   "])
            lines.append(indent + gap.join(rng.choices(words, k=rng.randint(0, 6))) +
                         rng.choice(["", " ", "  "]))
        docs.append("\n".join(lines) + rng.choice(["", "\n", "\n\n"]))
    return docs


def test_chunks_cut_at_line_ends_and_join_back():
    rng = random.Random()
    docs = _code_like(rng, 20) + ["x" * 50, "", "a\n" * 40]
    for doc in docs:
        parts = list(train_lib.chunks([doc], size=16))
        assert "".join(parts) == doc
        assert all(0 < len(p) <= 16 for p in parts)
        # every part but the last ends a line, unless one line is longer than a chunk
        assert all(
            p.endswith("\n") or "\n" not in doc[sum(map(len, parts[:i])):][:16]
            for i, p in enumerate(parts[:-1]))


def test_sentencepiece_is_lossless_on_code_and_prose(tmp_path):
    rng = random.Random()
    texts = _code_like(rng, 60) + [topics.topics[k] for k in sorted(topics.topics)[:20]]
    tok = train_lib.train_tokenizer(texts, "sentencepiece", 400, tmp_path / "sp.model")
    held_out = _code_like(rng, 20) + ["Grüße\n\n\t  東京 ✓  \n", "  leading", "trailing  "]
    for t in texts + held_out:
        assert tok.decode(tok.encode(t)) == t, repr(t[:80])
    assert tokenizer_lib.dropped_by(tok) == []
    # the bytes each token covers sum to the original text's (what bits per byte divides by)
    enc = tok.encode_batch(held_out)
    np.testing.assert_array_equal(
        np.add.reduceat(enc.token_bytes.astype(np.int64),
                        np.concatenate([[0], np.cumsum(enc.lens)[:-1]])),
        [len(t.encode("utf-8")) for t in held_out])
    assert "\n" in [tok.sp.IdToPiece(i) for i in tok.encode("a\nb")]  # a piece of its own


def test_a_model_that_drops_whitespace_is_loaded_with_one_warning_line(tmp_path, capsys):
    texts = [topics.topics[k] for k in sorted(topics.topics)[:20]]
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(texts),
                                   model_writer=model,
                                   vocab_size=400,
                                   byte_fallback=True,
                                   minloglevel=2)  # SentencePiece's defaults: nmt_nfkc
    path = tmp_path / "default.model"
    path.write_bytes(model.getvalue())
    tok = tokenizer_lib.load_tokenizer(str(path))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"experiments.tokenizer: warning: the SentencePiece model {path} "
                             "does not round-trip text")
    for dropped in ("newlines", "tabs", "runs of spaces"):
        assert dropped in err[0] and dropped in tokenizer_lib.dropped_by(tok)
    tokenizer_lib.load_tokenizer(str(path))
    assert capsys.readouterr().err == ""  # once per file
    lossless = train_lib.train_tokenizer(texts, "sentencepiece", 400, tmp_path / "sp.model")
    assert lossless.decode(lossless.encode(texts[0])) == texts[0]
    assert capsys.readouterr().err == ""


def test_cli_reports_what_it_read_and_samples_large_corpora(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [topics.topics[k] for k in sorted(topics.topics)[:30]]
    for i, t in enumerate(texts):
        (corpus / f"{i:02d}.md").write_text(t)
    (corpus / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:5]))
    seen = {}
    train = spm.SentencePieceTrainer.Train

    def spy(**kw):  # the real trainer, with its arguments kept
        seen.update(kw)
        return train(**kw)

    monkeypatch.setattr(spm.SentencePieceTrainer, "Train", spy)
    out = tmp_path / "sp.model"
    assert train_lib.main([
        "--data",
        str(corpus), "--vocab_size", "400", "--kind", "sentencepiece", "--out",
        str(out), "--input_sentence_size", "101"
    ]) == 0
    cap = capsys.readouterr()
    result = json.loads(cap.out)
    assert result["files"] == 31 and result["documents"] == 35
    assert result["bytes"] == sum(len(t.encode()) for t in texts + texts[:5])
    assert "training a sentencepiece tokenizer of 400 ids on the documents of 31 files" in cap.err
    assert seen["input_sentence_size"] == 101 and seen["normalization_rule_name"] == "identity"
    tok = tokenizer_lib.load_tokenizer(str(out))
    assert result["sha256"] == tok.sha256 and tok.decode(tok.encode(texts[3])) == texts[3]


@pytest.mark.parametrize("args, message", [
    (["--vocab_size", "100"], "--vocab_size=100 is invalid: at least 260"),
    (["--input_sentence_size", "-1"], r"--input_sentence_size=-1 is invalid: 0 \(every chunk\) "
     "or an int > 100"),
    (["--input_sentence_size", "50"], "--input_sentence_size=50 is invalid"),
    (["--vocab_size", "100000"], "SentencePiece training failed: .*Vocabulary size"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(topics.topics[sorted(topics.topics)[0]])
    argv = ["--data", str(corpus), "--kind", "sentencepiece", "--out", str(tmp_path / "x.model")]
    if "--vocab_size" not in args:
        argv += ["--vocab_size", "300"]
    assert train_lib.main(argv + args + ["--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("experiments.tokenizer: error: "), err
    assert re.search(message, err[-1]), err
    assert len(err) == 1 or "Vocabulary" in message  # (after the line saying training began)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_python_m_experiments_tokenizer_trains_one(tmp_path):
    """The documented command, ``python -m experiments.tokenizer``, runs train.main: a BPE
    tokenizer trained on fresh random text, written to --out, lossless on that text."""
    rng = random.Random()
    words = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 9))) for _ in range(400)]
    text = " ".join(words) + "\n\tend"
    (tmp_path / "doc.txt").write_text(text)
    out = tmp_path / "bpe.tokenizer.json"
    p = subprocess.run([
        sys.executable, "-m", "experiments.tokenizer", "--data",
        str(tmp_path / "doc.txt"), "--vocab_size", "300", "--kind", "bpe", "--out",
        str(out), "--no_progress"
    ],
                       capture_output=True,
                       text=True,
                       cwd=Path(__file__).resolve().parents[1],
                       timeout=300)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    tok = tokenizer_lib.load_tokenizer(str(out))
    assert result["kind"] == "bpe" and result["sha256"] == tok.sha256 and result["files"] == 1
    assert tok.decode(tok.encode(text)) == text
