"""The data pipeline's stages, in-process: documents from files, the tokenizers (trained here on a
small corpus, their ids checked against the library's own encode), the tokenized cache (reused,
rebuilt, never trusted half-written), packing, the grain feed's batches as a function of
(seed, step) and of the process's rows, and the one-line errors of bad input."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydoc_data import topics

from configs import base, experiments
from experiments.tokenizer import documents
from experiments.data import packing, pipeline, token_cache
from experiments.train import setup
from experiments import tokenizer as tokenizer_lib
from experiments.tokenizer.train import train_tokenizer
from experiments.tokenizer import job_copy as tokenizer_copy

# ------------------------------------------------------------------------------ fixtures


def _texts(n=40):
    keys = sorted(topics.topics)
    rng = np.random.default_rng()
    return [topics.topics[k] for k in rng.permutation(keys)[:n]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of .txt documents (one with non-ASCII text), a .jsonl and a .parquet file."""
    d = tmp_path_factory.mktemp("corpus")
    texts = _texts()
    texts[0] = "Grüße, naïve café — 東京 ✓\n" + texts[0]
    for i, t in enumerate(texts[:30]):
        (d / f"doc{i:02d}.txt").write_text(t, encoding="utf-8")
    with open(d / "more.jsonl", "w") as f:
        for t in texts[30:36]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": texts[36:]}), d / "rest.parquet")
    return d


@pytest.fixture(scope="module")
def toks(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    files, _ = documents.find_files(str(corpus))
    texts = [t for f in files for t in documents.read_documents(f)]
    return {
        "bpe": train_tokenizer(texts, "bpe", 600, out / "tokenizer.json"),
        "sentencepiece": train_tokenizer(texts, "sentencepiece", 600, out / "sp.model"),
    }


def _cfg(corpus, tmp_path, tok, **kw):
    return base.DataConfig(
        **{
            "path": str(corpus),
            "tokenizer": str(tok.path),
            "cache_dir": str(tmp_path / "cache"),
            "seq_len": 32,
            "batch_size": 4,
            **kw
        })


# ----------------------------------------------------------------------------- documents


def test_documents_of_every_kind_in_order(corpus):
    files, skipped = documents.find_files(str(corpus))
    assert [f.name for f in files][-2:] == ["more.jsonl", "rest.parquet"] and skipped == 0
    docs = [t for f in files for t in documents.read_documents(f)]
    assert len(docs) == 40 and docs[0].startswith("Grüße")
    glob_files, _ = documents.find_files(str(corpus / "doc0*.txt"))
    assert len(glob_files) == 10


@pytest.mark.parametrize("name,content,match", [
    ("a.jsonl", b'{"text": "ok"}\nnot json\n', r"a\.jsonl:2 is not JSON"),
    ("b.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', r"b\.jsonl:2 has no string field 'text'"),
    ("ids.txt", np.arange(300, dtype=np.uint32).tobytes(), r"NUL byte .* token ids"),
    ("latin.txt", "café".encode("latin-1"), r"latin\.txt is not UTF-8 text \(byte 3"),
])
def test_bad_documents_name_the_file_and_line(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(documents.DocumentError, match=match):
        list(documents.read_documents(tmp_path / name))


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(documents.DocumentError, match="no such file or directory"):
        documents.find_files(str(tmp_path / "nope"))
    (tmp_path / "x.bin").write_bytes(b"\1\2")
    with pytest.raises(documents.DocumentError, match=r"holds no \.txt"):
        documents.find_files(str(tmp_path))


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_ids_equal_the_librarys_encode_and_bytes_sum_to_the_text(toks, corpus, kind):
    tok = toks[kind]
    lib_encode = (lambda t: tok.tok.encode(t, add_special_tokens=False).ids) if kind == "bpe" \
        else tok.sp.EncodeAsIds
    files, _ = documents.find_files(str(corpus))
    for f in files[:3] + files[-2:]:
        for text in list(documents.read_documents(f))[:2]:
            ids, nb = tok.encode_with_bytes(text)
            assert list(ids) == lib_encode(text) == tok.encode(text)
            assert int(nb.sum()) == len(text.encode("utf-8")) and np.all(nb >= 0)
            assert tok.decode(ids) == text  # lossless: whitespace, newlines and tabs kept
    texts = [t for f in files for t in documents.read_documents(f)]
    assert [tok.decode(tok.encode(t)) for t in texts] == texts
    assert tokenizer_lib.dropped_by(tok) == []
    assert tok.eos_id is not None and tok.vocab_size == 600
    again = tokenizer_lib.load_tokenizer(str(tok.path))
    assert again.sha256 == tok.sha256 and type(again) is type(tok)


def _gpt2_byte_of_char() -> dict:
    """GPT-2's bytes_to_unicode, inverted: the byte each character of a byte-level token is."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece", "bytes"])
def test_batches_equal_the_librarys_encode_and_each_token_its_bytes(toks, corpus, kind):
    """encode_batch (the cache's path: for byte-level BPE ids without offsets and bytes from a
    table of the vocabulary) against the library's encode of each document; a document with a
    special token's text in it (matched by the library as that token, which covers no bytes in
    the table) takes its bytes from the offsets."""
    tok = toks[kind] if kind != "bytes" else tokenizer_lib.load_tokenizer("bytes")
    files, _ = documents.find_files(str(corpus))
    texts = [t for f in files for t in documents.read_documents(f)]
    rng = np.random.default_rng()
    texts = [texts[i] for i in rng.permutation(len(texts))[:12]]
    texts[rng.integers(12)] = "Grüße, naïve café — 東京 ✓\n"  # characters split across tokens
    texts += ["", "a </s> in the text"]
    enc = tok.encode_batch(texts)
    assert enc.ids.dtype == enc.token_bytes.dtype == np.uint32 and len(enc.lens) == len(texts)
    ends = np.cumsum(enc.lens)
    for d, text in enumerate(texts):
        ids = enc.ids[ends[d] - enc.lens[d]:ends[d]]
        nb = enc.token_bytes[ends[d] - enc.lens[d]:ends[d]]
        assert list(ids) == tok.encode(text)
        assert int(nb.sum()) == len(text.encode("utf-8"))
        if kind == "bpe" and "</s>" not in text:  # each token its own bytes
            byte_of = _gpt2_byte_of_char()
            pieces = [bytes(byte_of[c] for c in tok.tok.id_to_token(int(i))) for i in ids]
            assert b"".join(pieces) == text.encode("utf-8")
            np.testing.assert_array_equal(nb, [len(p) for p in pieces])
        if kind == "sentencepiece":  # each piece its own bytes of the text: <0xNN> one byte
            pieces = [tok.sp.IdToPiece(int(i)) for i in ids]
            pieces = [
                bytes([int(p[3:5], 16)])
                if tok.sp.IsByte(int(i)) else p.replace("\u2581", " ").encode()
                for p, i in zip(pieces, ids)
            ]
            assert b"".join(pieces) == text.encode("utf-8")
            np.testing.assert_array_equal(nb, [len(p) for p in pieces])
    if kind == "bpe":
        assert tok.byte_len is not None and tok.byte_len[tok.eos_id] == 0


def test_bytes_tokenizer_and_bad_tokenizer_files(tmp_path):
    b = tokenizer_lib.load_tokenizer("bytes")
    assert b.encode("hé") == list("hé".encode()) and b.eos_id is None and b.vocab_size == 256
    with pytest.raises(tokenizer_lib.TokenizerError, match="no such file"):
        tokenizer_lib.load_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(tokenizer_lib.TokenizerError, match="does not load as a SentencePiece"):
        tokenizer_lib.load_tokenizer(str(tmp_path / "bad.model"))
    (tmp_path / "tokenizer.json").write_text("{\"model\": 1}")
    with pytest.raises(tokenizer_lib.TokenizerError, match="does not load as a Hugging Face"):
        tokenizer_lib.load_tokenizer(str(tmp_path))


def test_job_dir_keeps_the_tokenizer_and_refuses_another(toks, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    for mode in (0o750, 0o755):  # the kept copy's folder is as open as the job directory
        other = tmp_path / f"job{mode:o}"
        other.mkdir()
        other.chmod(mode)
        tokenizer_copy.keep_in_job_dir(other, toks["bpe"])
        assert (other / "tokenizer").stat().st_mode & 0o7777 == mode
    tokenizer_copy.keep_in_job_dir(job, toks["bpe"])
    kept = tokenizer_copy.job_tokenizer(job)
    assert kept.sha256 == toks["bpe"].sha256 and kept.path.parent == job / "tokenizer"
    tokenizer_copy.check_job_tokenizer(job, toks["bpe"])
    with pytest.raises(tokenizer_lib.TokenizerError, match="was trained with the tokenizer"):
        tokenizer_copy.check_job_tokenizer(job, toks["sentencepiece"])
    assert isinstance(tokenizer_copy.job_tokenizer(tmp_path), tokenizer_lib.ByteTokenizer)


# ---------------------------------------------------------------------------------- cache


def test_cache_holds_the_encoded_documents_is_reused_and_rebuilt(toks, corpus, tmp_path):
    tok = toks["bpe"]
    files, _ = documents.find_files(str(corpus))
    kw = {"add_bos": True, "add_eos": True, "cache_dir": tmp_path, "progress": False}
    c1 = token_cache.build_or_load(files, tok, **kw)
    assert c1.built and c1.num_documents == 40
    docs = [t for f in files for t in documents.read_documents(f)]
    for i in (0, 17, 39):
        got = c1.tokens[c1.doc_starts[i]:c1.doc_starts[i + 1]]
        assert list(got) == [tok.bos_id] + tok.encode(docs[i]) + [tok.eos_id]
        nb = c1.token_bytes[c1.doc_starts[i]:c1.doc_starts[i + 1]]
        assert nb[0] == nb[-1] == 0 and int(nb.sum()) == len(docs[i].encode())
    assert int(c1.token_bytes.sum()) == sum(len(t.encode()) for t in docs) == c1.meta["bytes"]
    c2 = token_cache.build_or_load(files, tok, **kw)
    assert not c2.built and c2.path == c1.path
    # a changed file (new content, new mtime) is another key: rebuilt
    work = tmp_path / "work"
    shutil.copytree(corpus, work)
    (work / "none.jsonl").write_text("\n")  # a file of no documents: an empty shard
    files_w, _ = documents.find_files(str(work))
    w1 = token_cache.build_or_load(files_w, tok, cache_dir=tmp_path, progress=False)
    assert w1.num_documents == 40 and len(w1.tokens) == len(c1.tokens) - 2 * 40  # no BOS, EOS
    files_w[3].write_text("a different document")
    os.utime(files_w[3], ns=(1, 1))
    w2 = token_cache.build_or_load(files_w, tok, cache_dir=tmp_path, progress=False)
    assert w2.built and w2.path != w1.path and w2.num_documents == 40
    assert list(w2.tokens[w2.doc_starts[3]:w2.doc_starts[4]]) == tok.encode("a different document")


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_many_small_files_are_encoded_many_documents_per_call(toks, tmp_path, monkeypatch, kind):
    """Small files are grouped into shards: one library call encodes documents of many files
    (the library's batch parallelism and its per-call cost then pay off), and the corpus is
    each document's own encoding, in file order."""
    tok = toks[kind]
    rng = np.random.default_rng()
    words = np.array(["def", "x", "  ", "\n", "return", "café", "\t", "(", ")", ":", "1"])
    texts = ["".join(rng.choice(words, rng.integers(1, 40))) for _ in range(80)]
    folder = tmp_path / "small"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    files, _ = documents.find_files(str(folder))
    calls = []
    real = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda batch: calls.append(len(batch)) or real(batch))
    got = token_cache.build_or_load(files, tok, cache_dir=tmp_path / "c", progress=False, workers=2)
    assert sum(calls) == 80 and len(calls) <= 16, calls  # about 4 groups a worker, not 80
    for d, t in enumerate(texts):
        assert list(got.tokens[got.doc_starts[d]:got.doc_starts[d + 1]]) == tok.encode(t)


def test_an_interrupted_build_leaves_nothing_trusted(toks, corpus, tmp_path, monkeypatch):
    tok = toks["sentencepiece"]
    files, _ = documents.find_files(str(corpus))
    calls = {"n": 0}
    real = tok.encode_batch

    def dying(texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of the build
        return real(texts)

    monkeypatch.setattr(tok, "encode_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        token_cache.build_or_load(files, tok, cache_dir=tmp_path / "c", progress=False, workers=1)
    assert not [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".tmp.")]
    # a killed process leaves its temporary directory: a later build ignores and removes it
    (tmp_path / "c" / f".tmp.{token_cache.cache_key(files, tok, {})}.999999999").mkdir()
    monkeypatch.setattr(tok, "encode_batch", real)
    got = token_cache.build_or_load(files, tok, cache_dir=tmp_path / "c", progress=False)
    fresh = token_cache.build_or_load(files, tok, cache_dir=tmp_path / "d", progress=False)
    assert got.built and got.path.name == fresh.path.name
    np.testing.assert_array_equal(got.tokens, fresh.tokens)
    np.testing.assert_array_equal(got.doc_starts, fresh.doc_starts)


# -------------------------------------------------------------------------------- packing


def test_document_packing_rows():
    rng = np.random.default_rng()
    lens = rng.integers(1, 30, size=50)
    starts = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.arange(starts[-1], dtype=np.uint32) + 7
    nbytes = rng.integers(1, 4, size=starts[-1]).astype(np.uint32)
    plan = packing.plan_rows(starts, 17)
    # every token in one piece, the pieces in order, each row's pieces fit it
    np.testing.assert_array_equal(
        np.concatenate([np.arange(a, a + n) for a, n in zip(plan.piece_start, plan.piece_len)]),
        np.arange(starts[-1]))
    ends = starts[np.searchsorted(starts, plan.piece_start, side="right")]
    assert np.all(plan.piece_start + plan.piece_len <= ends)  # no piece crosses a document
    for r in range(plan.num_rows):
        assert plan.piece_len[plan.row_ptr[r]:plan.row_ptr[r + 1]].sum() <= 17
        row = packing.document_row(plan, r, tokens, nbytes, 16)
        seg = row["segment_ids"]
        for k in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == k)
            np.testing.assert_array_equal(row["segment_pos"][at], np.arange(len(at)))
            p = plan.row_ptr[r] + k - 1
            np.testing.assert_array_equal(row["ids"][at],
                                          tokens[plan.piece_start[p]:][:len(at)].astype(np.int32))
        # a label counts only where it continues its input's piece
        w = row["weights"] > 0
        assert np.all(row["labels"][w] == row["ids"][w] + 1)
        assert np.all(row["label_bytes"][~w] == 0) and np.all(row["ids"][seg == 0] == 0)


@pytest.mark.parametrize("packing_kind", ["concat", "documents"])
def test_batches_are_a_function_of_seed_and_step_and_split_by_rows(toks, corpus, tmp_path,
                                                                   packing_kind):
    cfg = _cfg(corpus, tmp_path, toks["bpe"], packing=packing_kind, batch_size=8)
    ds = pipeline.load_token_dataset(cfg, progress=False)
    again = pipeline.load_token_dataset(cfg, progress=False)
    a = ds.train_batch(11)
    for k, v in a.items():
        np.testing.assert_array_equal(v, again.train_batch(11)[k])
    assert not np.array_equal(a["ids"], ds.train_batch(12)["ids"])
    # two processes holding rows [0, 4) and [4, 8) read disjoint halves of the same batch
    halves = [ds.train_batch(11, (0, 4)), ds.train_batch(11, (4, 8))]
    for k in a:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), a[k])
    ev = ds.eval_batches(2)
    assert len(ev) == 2 and ev[0]["ids"].shape == (8, 32)
    assert int(np.max(a["ids"])) < toks["bpe"].vocab_size
    assert "segment_ids" in a if packing_kind == "documents" else "segment_ids" not in a


def test_bits_per_byte():
    w = np.ones((2, 3), np.float32)
    batches = [{"weights": w, "label_bytes": np.full((2, 3), 2)}, {"weights": w}]
    # (1.0 * 6 + 3.0 * 6) nats over 12 + 6 bytes
    assert math.isclose(pipeline.bits_per_byte([1.0, 3.0], batches), 24 / 18 / math.log(2))


# --------------------------------------------------------------------------- bad configs


def test_bad_data_configs(toks, corpus, tmp_path):
    with pytest.raises(ValueError, match="source='pydoc' is invalid: data.path="):
        base.DataConfig(source="pydoc", path=str(corpus))
    with pytest.raises(ValueError, match="source='pydoc' is byte-level"):
        base.DataConfig(tokenizer=str(toks["bpe"].path))
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("just a few words")
    with pytest.raises(ValueError, match=r"leaves \d+ tokens in the train split"):
        pipeline.load_token_dataset(_cfg(small, tmp_path, toks["bpe"]), progress=False)
    assert list((tmp_path / "cache").iterdir()) == []  # its tokenized entry is not left behind
    with pytest.raises(ValueError, match=r"held-out split .* less than one batch"):
        pipeline.load_token_dataset(_cfg(corpus, tmp_path, toks["bpe"], batch_size=4096),
                                    progress=False)
    cfg = _cfg(corpus, tmp_path, toks["bpe"])
    with pytest.raises(ValueError, match="add_bos=True but the tokenizer bytes has no BOS"):
        pipeline.load_token_dataset(base.DataConfig(path=str(corpus), add_bos=True), progress=False)
    model = experiments.Tiny().model()
    model.vocab_size = 512
    with pytest.raises(setup.ConfigError, match="vocab_size=512 is smaller than the tokenizer"):
        setup._set_vocab(model, cfg, None)
    model.vocab_size = None
    setup._set_vocab(model, cfg, None)
    assert model.vocab_size == 640  # 600 rounded up to a multiple of 128
