"""`python -m experiments.main --mode=sample`: its report, --output_json, a job directory left
as it was, and bad input as one line naming the value and the fix (exit status 2)."""

import json
import os
from pathlib import Path

import pytest

from experiments import main as main_lib
from tests import sample_util
from tests.flagutil import parse, reset_flags  # noqa: F401  (autouse fixture)
from tests.main_util import run_main


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def test_sample_prints_writes_json_and_leaves_the_job_dir(tmp_path):
    job = sample_util.make_job(tmp_path / "job", "tiny")
    before = _snapshot(job)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n  return\n")
    out = tmp_path / "out.json"
    p = run_main([
        "--mode=sample", f"--job_log_dir={job}", "--prompt=Hello", f"--prompts_file={prompts}",
        "--max_new_tokens=6", "--temperature=0.7", "--top_k=40", "--num_samples=2", "--seed=3",
        f"--output_json={out}", "--no_progress"
    ])
    assert _snapshot(job) == before  # nothing written, nothing touched
    for i, prompt in enumerate(["Hello", "def f(x):", "  return"]):
        assert f"=== prompt {i}: {prompt!r}" in p.stdout
    assert "tokens/s" in p.stdout and "ms per token" in p.stdout and "prefill" in p.stdout
    record = json.loads(out.read_text())
    assert record["checkpoint_step"] == 7 and record["tokenizer"] == "bytes"
    assert record["settings"]["temperature"] == 0.7 and record["settings"]["seed"] == 3
    assert [r["prompt"] for r in record["results"]] == ["Hello", "def f(x):", "  return"]
    for r in record["results"]:
        assert r["prompt_ids"] == list(r["prompt"].encode())
        assert len(r["samples"]) == 2
        for s in r["samples"]:
            assert len(s["token_ids"]) == len(s["log_probs"]) == 6
            assert all(lp <= 0 for lp in s["log_probs"])
            assert s["text"] == bytes(s["token_ids"]).decode("utf-8", errors="replace")
            assert f"{r['prompt']}{s['text']}" in p.stdout
    assert record["decode_tokens_per_second"] > 0 and record["rows"] == 6


def test_bad_input_is_one_line_and_exit_status_2(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "config.json").write_text(sample_util.config_json("tiny"))
    p = run_main(["--mode=sample", f"--job_log_dir={job}", "--prompt=Hi"], check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no checkpoint in" in lines[0], p.stderr
    assert "train first" in lines[0]
    assert sorted(os.listdir(job)) == ["config.json"]  # no checkpoints/ made


@pytest.mark.parametrize("args, message", [
    (["--temperature=-1"], "--temperature=-1.0 is invalid: give a finite value >= 0"),
    (["--top_p=0"], r"--top_p=0.0 is invalid: give a value in \(0, 1\]"),
    (["--top_p=1.2"], r"--top_p=1.2 is invalid"),
    (["--top_k=-3"], "--top_k=-3 is invalid: give an int >= 0"),
    (["--num_samples=0"], "--num_samples=0 is invalid: give an int >= 1"),
    (["--prompt="], "prompt 0 is empty"),
    (["--max_new_tokens=70"], r"prompt 0 is 2 tokens: with --max_new_tokens=70 that is 72, "
     r"longer than the model's context of 64 tokens \(data.seq_len\); shorten the prompt or "
     r"give --max_new_tokens <= 62"),
    (["--exp=tiny"], "--mode=sample samples the config recorded in --job_log_dir; drop --exp"),
])
def test_bad_flags(tmp_path, args, message):
    """Checked before anything is restored or compiled (the job directory has a config and an
    empty checkpoint step, which a restore would fail on)."""
    job = tmp_path / "job"
    (job / "checkpoints" / "1").mkdir(parents=True)
    (job / "config.json").write_text(sample_util.config_json("tiny"))
    prompt = [] if any(a.startswith("--prompt=") for a in args) else ["--prompt=Hi"]
    parse("--mode=sample", f"--job_log_dir={job}", *prompt, *args)
    with pytest.raises(main_lib.UsageError, match=message):
        main_lib.main(["main"])


def test_no_prompt(tmp_path):
    job = tmp_path / "job"
    (job / "checkpoints" / "1").mkdir(parents=True)
    (job / "config.json").write_text(sample_util.config_json("tiny"))
    parse("--mode=sample", f"--job_log_dir={job}")
    with pytest.raises(main_lib.UsageError, match="no prompt given: pass --prompt=TEXT"):
        main_lib.main(["main"])
