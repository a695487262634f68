"""The data pipeline end to end: packed documents isolated from each other inside the Praxis LM,
and `python -m experiments.main` training, resuming (bitwise) and evaluating on a folder of
text with a SentencePiece and a BPE tokenizer trained here, and two processes (jax.distributed)
reading disjoint rows of each batch and training as one process does."""

import json
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from praxis import base_layer, pax_fiddle, py_utils
from pydoc_data import topics

from configs import models
from experiments.tokenizer import documents
from experiments.data import packing
from experiments.tokenizer.train import train_tokenizer
from experiments.train.steps import _model_inputs, _segments
from tests.main_util import ROOT, SMALL, main_env, records, run_main


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
        "compile_cache": tmp_path_factory.mktemp("compile_cache"),
        "dir": d,
        "bpe": train_tokenizer(texts, "bpe", 512, tok / "tokenizer.json").path,
        "sentencepiece": train_tokenizer(texts, "sentencepiece", 512, tok / "sp.model").path,
    }


# Tiny with one MoE layer (of 2) and a batch of 8 x 32 tokens: what is checked here is the
# data's way through the runner, not the model
LEAN = [
    "--exp=tiny", "--fdl.model.stacked_transformer_tpl.num_layers=1",
    "--fdl.model.stacked_transformer_tpl.moe_layers=[0]", *SMALL
]


def _flags(folder, kind, tmp_path, *extra):
    return [
        *LEAN, f"--fdl.data.path='{folder['dir']}'", f"--fdl.data.tokenizer='{folder[kind]}'",
        f"--fdl.data.cache_dir='{tmp_path / 'cache'}'", "--fdl.data.packing='documents'", *extra
    ]


def _run(folder, args, **kw):
    """run_main with the module's compile cache: the runs of a test compile once."""
    return run_main(args, compile_cache=folder["compile_cache"], **kw)


def test_cli_sentencepiece_kill_and_resume_is_bitwise(folder, tmp_path):
    common = [
        "--fdl.train.num_steps=4", "--fdl.train.eval_every=2", "--fdl.train.checkpoint_every=0"
    ]
    ref, job = tmp_path / "ref", tmp_path / "job"
    p = _run(folder, [f"--job_log_dir={ref}", *_flags(folder, "sentencepiece", tmp_path, *common)])
    assert "tokenizer sp.model (512 ids), model vocabulary 512, packing documents" in p.stdout
    assert "bits per byte" in p.stdout
    p = _run(folder, [
        f"--job_log_dir={job}", "--fdl.train.sigterm_at_step=2",
        *_flags(folder, "sentencepiece", tmp_path, *common)
    ],
             check=False)
    assert p.returncode == 143 and "stopped by SIGTERM at step 2" in p.stdout, p.stderr[-2000:]
    assert "(reused)" in p.stdout  # the first run's cache
    p = _run(folder, [f"--job_log_dir={job}", *_flags(folder, "sentencepiece", tmp_path, *common)])
    got = {r["step"]: r["loss"] for r in records(job, "train")}
    want = {r["step"]: r["loss"] for r in records(ref, "train")}
    assert sorted(got) == list(range(1, 5)) and [got[s] for s in got] == [want[s] for s in got]
    ev = {r["step"]: r["heldout_bits_per_byte"] for r in records(job, "eval")}
    assert ev == {r["step"]: r["heldout_bits_per_byte"] for r in records(ref, "eval")}
    assert sorted(ev) == [0, 2, 4] and 0 < ev[4] < ev[0]
    assert (job / "tokenizer" / "sp.model").is_file()


def test_cli_bpe_trains_evaluates_and_refuses_another_tokenizer(folder, tmp_path):
    """Eval of the job as it is uses its own tokenizer copy, though a new file now sits at the
    path it was trained from; a tokenizer the user gives must be the kept one."""
    job = tmp_path / "job"
    steps = ["--fdl.train.num_steps=2", "--fdl.train.eval_every=2"]
    mine = {**folder, "bpe": tmp_path / "tokenizer.json"}
    shutil.copyfile(folder["bpe"], mine["bpe"])
    _run(folder, [f"--job_log_dir={job}", *_flags(mine, "bpe", tmp_path, *steps)])
    shutil.copyfile(folder["sentencepiece"], mine["bpe"])  # a new file at the original path
    p = _run(folder, [f"--job_log_dir={job}", "--mode=eval", "--no_progress"])
    result = json.loads(p.stdout[p.stdout.index("\n{") + 1:])
    assert result["step"] == 2 and result["heldout_bits_per_byte"] > 0
    assert result["heldout_loss"] == pytest.approx(records(job, "eval")[-1]["heldout_loss"])
    p = _run(folder, [
        f"--job_log_dir={job}", "--mode=eval", "--no_progress",
        f"--fdl.data.tokenizer='{mine['bpe']}'"
    ],
             check=False)
    assert p.returncode == 2 and "was trained with the tokenizer" in p.stderr, p.stderr
    p = _run(folder, [f"--job_log_dir={job}", *_flags(folder, "sentencepiece", tmp_path, *steps)],
             check=False)
    assert p.returncode == 2 and "experiments.main: error:" in p.stderr
    assert "was trained with the tokenizer" in p.stderr or "data.tokenizer" in p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# experiments.main with every read of a training batch's rows logged to $ROWS_LOG
SPY_ROWS = r"""
import json, os
from experiments import main
from experiments.data import pipeline
read = pipeline.TokenDataset.train_batch
def train_batch(self, step, rows=None):
    with open(os.environ["ROWS_LOG"], "a") as f:
        f.write(json.dumps([int(step), rows and [int(r) for r in rows]]) + "\n")
    return read(self, step, rows)
pipeline.TokenDataset.train_batch = train_batch
main.run()
"""


@pytest.mark.slow
def test_two_processes_read_disjoint_rows_and_train_as_one(folder, tmp_path):
    """Two processes of 4 CPU devices (jax.distributed over gloo) on the BPE-tokenized folder,
    packed by documents, each building the cache at once: each reads only its own 4 rows of
    every global batch of 8, and the losses are one process of 8 devices'."""
    steps = ("--fdl.train.num_steps=2", "--fdl.train.eval_every=2", "--fdl.train.eval_batches=1",
             "--fdl.train.checkpoint_every=0")
    one = tmp_path / "one"
    run_main([f"--job_log_dir={one}", *_flags(folder, "bpe", tmp_path / "one", *steps)], devices=8)
    two, port = tmp_path / "two", _free_port()
    procs = [
        subprocess.Popen([
            sys.executable, "-c", SPY_ROWS, f"--job_log_dir={two}", "--num_processes=2",
            f"--process_id={i}", f"--coordinator_address=localhost:{port}",
            *_flags(folder, "bpe", tmp_path / "two", *steps)
        ],
                         cwd=ROOT,
                         env={
                             **main_env(4), "ROWS_LOG": str(tmp_path / f"rows{i}.jsonl")
                         },
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         text=True) for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    chief = outs[0][0]
    assert "8 cpu devices in 2 process(es), mesh {'data': 8}" in chief
    assert "tokenizer tokenizer.json (512 ids), model vocabulary 512, packing documents" in chief
    for i in range(2):
        log = [json.loads(line) for line in (tmp_path / f"rows{i}.jsonl").read_text().splitlines()]
        # the feed's reads (rows None: the whole first batch, which the loop lowers the train
        # step with, for its shapes)
        read = [(step, tuple(rows)) for step, rows in log if rows is not None]
        assert sorted(read) == [(s, (4 * i, 4 * i + 4)) for s in range(2)], log
    a, b = records(one, "train"), records(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    # Same mesh shape, same global batches: equal up to the order of the cross-device sums
    # (gloo's all-reduce vs XLA:CPU's in-process one), float32 rounding.
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=2e-5)
    ea, eb = records(one, "eval"), records(two, "eval")
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == [0, 2]
    for k in ("heldout_loss", "heldout_bits_per_byte"):
        np.testing.assert_allclose([r[k] for r in eb], [r[k] for r in ea], rtol=2e-5)
