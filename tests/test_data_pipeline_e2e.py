"""The data pipeline end to end: packed documents isolated from each other inside the Praxis LM,
and `python -m experiments.main` training, resuming (bitwise) and evaluating on a folder of
text with a SentencePiece and a BPE tokenizer trained here."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from praxis import base_layer, pax_fiddle, py_utils
from pydoc_data import topics

from configs import models
from experiments import documents, packing
from experiments import tokenizer as tokenizer_lib
from experiments.steps import _model_inputs, _segments
from tests.main_util import SMALL, records, run_main


def test_a_document_changed_leaves_the_other_documents_logits_alone():
    """Two rows of three packed documents that differ only in the middle one: the logits of
    the first and last documents are the same (attention and rotary positions stay inside a
    document). Dense layers: an MoE layer's expert capacity is shared by the row's tokens."""
    lm = pax_fiddle.build(
        models.transformer_lm(vocab_size=64,
                              model_dims=32,
                              hidden_dims=32,
                              num_layers=2,
                              num_heads=2,
                              num_experts=2,
                              moe_layers=[]))
    rng = np.random.default_rng()
    lens = [9, 7, 17]  # rows of 33 tokens
    starts = np.concatenate([[0], np.cumsum(lens)])
    plan = packing.plan_rows(starts, 33)
    assert plan.num_rows == 1
    a = rng.integers(0, 64, starts[-1]).astype(np.uint32)
    b = a.copy()
    b[starts[1]:starts[2]] = rng.integers(0, 64, lens[1])
    nb = np.ones(starts[-1], np.uint32)
    rows = packing.stack_rows([packing.document_row(plan, 0, t, nb, 32) for t in (a, b)])
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "label_bytes"}
    ids, paddings, labels = _model_inputs(batch)
    variables = lm.init({
        base_layer.PARAMS: jax.random.key(0),
        base_layer.RANDOM: jax.random.key(1)
    },
                        ids,
                        paddings,
                        labels=labels,
                        **_segments(batch))
    out = lm.apply(variables, ids, paddings, labels=labels, **_segments(batch))
    logits = np.asarray(out.logits, np.float32)
    seg = rows["segment_ids"][0]
    same = (seg == 1) | (seg == 3)
    np.testing.assert_allclose(logits[0][same], logits[1][same], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[0][seg == 2], logits[1][seg == 2], atol=1e-3)
    # without the segments the last document would see the changed one
    plain = lm.apply(variables, ids, paddings, labels=labels)
    assert not np.allclose(plain.logits[0][seg == 3], plain.logits[1][seg == 3], atol=1e-3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    for i, k in enumerate(sorted(topics.topics)[:40]):
        (d / f"{i:02d}.txt").write_text(topics.topics[k])
    files, _ = documents.find_files(str(d))
    texts = [t for f in files for t in documents.read_documents(f)]
    tok = tmp_path_factory.mktemp("tok")
    return {
        "dir":
        d,
        "bpe":
        tokenizer_lib.train_tokenizer(texts, "bpe", 512, tok / "tokenizer.json").path,
        "sentencepiece":
        tokenizer_lib.train_tokenizer(tokenizer_lib._lines(texts), "sentencepiece", 512,
                                      tok / "sp.model").path,
    }


def _flags(folder, kind, tmp_path, *extra):
    return [
        "--exp=tiny", f"--fdl.data.path='{folder['dir']}'",
        f"--fdl.data.tokenizer='{folder[kind]}'", f"--fdl.data.cache_dir='{tmp_path / 'cache'}'",
        "--fdl.data.packing='documents'", *SMALL, *extra
    ]


def test_cli_sentencepiece_kill_and_resume_is_bitwise(folder, tmp_path):
    common = [
        "--fdl.train.num_steps=6", "--fdl.train.eval_every=3", "--fdl.train.checkpoint_every=0"
    ]
    ref, job = tmp_path / "ref", tmp_path / "job"
    p = run_main([f"--job_log_dir={ref}", *_flags(folder, "sentencepiece", tmp_path, *common)])
    assert "tokenizer sp.model (512 ids), model vocabulary 512, packing documents" in p.stdout
    assert "bits per byte" in p.stdout
    p = run_main([
        f"--job_log_dir={job}", "--fdl.train.sigterm_at_step=3",
        *_flags(folder, "sentencepiece", tmp_path, *common)
    ],
                 check=False)
    assert p.returncode == 143 and "stopped by SIGTERM at step 3" in p.stdout, p.stderr[-2000:]
    assert "(reused)" in p.stdout  # the first run's cache
    p = run_main([f"--job_log_dir={job}", *_flags(folder, "sentencepiece", tmp_path, *common)])
    got = {r["step"]: r["loss"] for r in records(job, "train")}
    want = {r["step"]: r["loss"] for r in records(ref, "train")}
    assert sorted(got) == list(range(1, 7)) and [got[s] for s in got] == [want[s] for s in got]
    ev = {r["step"]: r["heldout_bits_per_byte"] for r in records(job, "eval")}
    assert ev == {r["step"]: r["heldout_bits_per_byte"] for r in records(ref, "eval")}
    assert 0 < ev[6] < ev[0]
    assert (job / "tokenizer" / "sp.model").is_file()


def test_cli_bpe_trains_evaluates_and_refuses_another_tokenizer(folder, tmp_path):
    job = tmp_path / "job"
    steps = ["--fdl.train.num_steps=2", "--fdl.train.eval_every=2"]
    run_main([f"--job_log_dir={job}", *_flags(folder, "bpe", tmp_path, *steps)])
    p = run_main([f"--job_log_dir={job}", "--mode=eval", "--no_progress"])
    result = json.loads(p.stdout[p.stdout.index("\n{") + 1:])
    assert result["step"] == 2 and result["heldout_bits_per_byte"] > 0
    assert result["heldout_loss"] == pytest.approx(records(job, "eval")[-1]["heldout_loss"])
    p = run_main([f"--job_log_dir={job}", *_flags(folder, "sentencepiece", tmp_path, *steps)],
                 check=False)
    assert p.returncode == 2 and "experiments.main: error:" in p.stderr
    assert "was trained with the tokenizer" in p.stderr or "data.tokenizer" in p.stderr
