"""experiments.sample on jobs trained with a subword tokenizer: a byte-level BPE (`tokenizers`)
of 300 ids and a SentencePiece unigram model of 400, trained here on pydoc topics, so the
model's vocabulary is 384 / 512 (the tokenizer's rounded up to a multiple of 128: ids that are
no token).

Each job (tests/sample_util.py: the recorded config names the tokenizer and the job directory
keeps its copy, as training leaves it; data.add_bos on) is sampled on its mesh:
- the BPE job greedily through ``experiments.sample.continuations`` (what ``generate`` and
  ``--mode=sample`` run), with and without the KV cache: cached == full recompute, token for
  token, 32 new tokens (``generate`` returns ``continuations(...).texts``);
- the SentencePiece job by the CLI (temperature 0.9, --output_json).
Both: every generated id is a token of the tokenizer (the rounded-up ids are never drawn), each
prompt is the tokenizer's ``encode`` with its BOS first, each text the tokenizer's ``decode`` of
the generated ids (EOS left out). A job whose tokenizer copy is missing, changed or without its
hash is one line naming the fix.
"""

import json
import shutil
from pydoc_data import topics

import pytest

from experiments import main as main_lib
from experiments import sample
from experiments.tokenizer.train import train_tokenizer
from experiments.tokenizer import job_copy as tokenizer_copy
from tests import sample_util, testutil
from tests.flagutil import parse, reset_flags  # noqa: F401  (autouse fixture)

NEW = 32
VOCAB = {"bpe": 300, "sentencepiece": 400}  # SentencePiece needs room for the characters
PROMPTS = ["The tokenizer", "def main(", "a"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """kind -> (job directory, the tokenizer it trained with)."""
    corpus = tmp_path_factory.mktemp("corpus")
    texts = [topics.topics[k] for k in sorted(topics.topics)[:20]]
    for i, t in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_text(t)
    tok_dir = tmp_path_factory.mktemp("tok")
    toks = {
        "bpe":
        train_tokenizer(texts, "bpe", VOCAB["bpe"], tok_dir / "tokenizer.json"),
        "sentencepiece":
        train_tokenizer(texts, "sentencepiece", VOCAB["sentencepiece"], tok_dir / "sp.model"),
    }
    made = {}
    for kind, tok in toks.items():
        assert tok.vocab_size == VOCAB[kind] and tok.bos_id is not None
        data = {"path": str(corpus), "tokenizer": str(tok.path), "add_bos": True}
        job = sample_util.make_job(tmp_path_factory.mktemp(kind),
                                   "tiny",
                                   seed=testutil.seed() % (1 << 30),
                                   data=data)
        assert (job / "tokenizer" / tok.path.name).is_file()
        made[kind] = job, tok
    return made


def _settings(**kw):
    return {**dict(max_new_tokens=NEW, temperature=0.0, top_k=0, top_p=1.0, num_samples=1), **kw}


def test_greedy_cached_equals_recompute_with_the_jobs_tokenizer(jobs):
    job, tok = jobs["bpe"]
    cached = sample.continuations(job, PROMPTS, _settings())
    full = sample.continuations(job, PROMPTS, _settings(), use_cache=False)
    assert cached.tokenizer.sha256 == tok.sha256 and cached.tokenizer.vocab_size == VOCAB["bpe"]
    assert cached.samples.tokens == full.samples.tokens
    assert all(len(t) == NEW for t in cached.samples.tokens)
    assert len({tuple(t) for t in cached.samples.tokens}) > 1  # not one degenerate continuation
    assert all(0 <= t < VOCAB["bpe"] for row in cached.samples.tokens for t in row)
    assert cached.samples.prompts == [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    want = [[tok.decode([t for t in ids if t != tok.eos_id])] for ids in cached.samples.tokens]
    assert cached.texts == full.texts == want
    assert cached.samples.dropped == 0


def test_cli_output_json_with_a_sentencepiece_job(jobs, tmp_path, capsys):
    job, tok = jobs["sentencepiece"]
    out = tmp_path / "out.json"
    parse("--mode=sample", f"--job_log_dir={job}", *[f"--prompt={p}" for p in PROMPTS],
          f"--max_new_tokens={NEW}", "--temperature=0.9", "--num_samples=2", "--seed=4",
          f"--output_json={out}", "--no_progress")
    assert main_lib.main(["main"]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["tokenizer"] == "sp.model"
    for r, prompt in zip(record["results"], PROMPTS):
        assert r["prompt_ids"] == [tok.bos_id] + tok.encode(prompt)
        for s in r["samples"]:
            assert len(s["token_ids"]) == len(s["log_probs"]) == NEW
            assert all(0 <= t < VOCAB["sentencepiece"] for t in s["token_ids"]), s["token_ids"]
            assert s["text"] == tok.decode([t for t in s["token_ids"] if t != tok.eos_id])
            assert f"{prompt}{s['text']}" in printed


@pytest.mark.parametrize("damage, message", [
    ("remove the file", r"tokenizer copy of --job_log_dir=.* does not load \(TokenizerError: "
     r".*tokenizer lacks its tokenizer file: .*incomplete.*\): restore .*tokenizer/ \(the "
     r"file and its tokenizer.sha256\)"),
    ("remove the directory", r"was trained with data.tokenizer='.*tokenizer.json' but keeps no "
     r"copy of it in .*tokenizer: restore .*tokenizer/ \(the file and its tokenizer.sha256\)"),
    ("change the file", r"tokenizer copy of --job_log_dir=.* does not load \(TokenizerError: "
     r".* has sha256 .*the job's tokenizer copy was changed.*\): restore"),
    ("remove the hash", r"tokenizer copy of --job_log_dir=.* does not load \(TokenizerError: "
     r".*tokenizer.sha256.*\): restore"),
])
def test_a_missing_or_changed_tokenizer_copy_is_one_line(jobs, tmp_path, damage, message):
    """Refused before anything is restored; the CLI says it in one line (exit status 2)."""
    job = tmp_path / "job"
    shutil.copytree(jobs["bpe"][0], job)
    kept = job / "tokenizer" / "tokenizer.json"
    if damage == "remove the file":
        kept.unlink()
    elif damage == "remove the directory":
        shutil.rmtree(kept.parent)
    elif damage == "change the file":
        kept.write_text(kept.read_text().replace('"<unk>"', '"<UNK>"'))
    else:
        (job / "tokenizer" / tokenizer_copy.HASH_FILE).unlink()
    with pytest.raises(sample.SampleError, match=message):
        sample.generate(job, ["Hi"], max_new_tokens=4)
    parse("--mode=sample", f"--job_log_dir={job}", "--prompt=Hi")
    with pytest.raises(main_lib.UsageError, match=message):
        main_lib.main(["main"])


@pytest.mark.slow
def test_a_new_file_at_the_tokenizers_path_leaves_the_job_on_its_own_copy(jobs, tmp_path):
    """The job's checksummed copy is what sampling uses, whatever the path it was trained from
    holds now (another tokenizer here)."""
    _, tok = jobs["bpe"]
    path = tmp_path / "tokenizer.json"
    shutil.copyfile(tok.path, path)
    data = {"path": str(tmp_path), "tokenizer": str(path), "add_bos": True}
    job = sample_util.make_job(tmp_path / "job", "tiny", data=data)
    shutil.copyfile(jobs["sentencepiece"][1].path, path)  # a new file at the original path
    got = sample.continuations(job, PROMPTS, _settings(max_new_tokens=4))
    assert got.tokenizer.sha256 == tok.sha256
    assert got.samples.prompts == [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    assert got.texts == [[tok.decode([t for t in ids if t != tok.eos_id])]
                         for ids in got.samples.tokens]
