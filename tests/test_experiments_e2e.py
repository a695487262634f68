"""End-to-end runs of `python -m experiments.main` in subprocesses: the loss falls and every
output is written, kill-and-resume gives the uninterrupted run's losses, and every GPU-scale
preset traces (eval_shape) on fake devices. (Two processes of 4 CPU devices against one of 8:
tests/test_data_pipeline_e2e.py, on a tokenized corpus.)

Runs use the Tiny model with a smaller batch (8 x 32 bytes) to stay within the suite's time
budget; the README's 200-step numbers are for the default Tiny run (`make run`)."""

import ast
import json
import re
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from configs import experiments, meshes
from experiments import data as data_lib
from experiments.train import setup, steps

from tests.main_util import ROOT, SMALL, main_env, records, run_main

pytestmark = pytest.mark.slow


def _tensorboard_tags(tb_dir):
    """(tag, kind) of every summary value in the event files (TFRecord framing: length u64,
    crc u32, Event proto, crc u32)."""
    tags = set()
    files = list(Path(tb_dir).glob("events.out.tfevents.*"))
    assert files
    for f in files:
        b, i = f.read_bytes(), 0
        while i < len(b):
            n = struct.unpack("<Q", b[i:i + 8])[0]
            e = event_pb2.Event()
            e.ParseFromString(b[i + 12:i + 12 + n])
            i += 12 + n + 4
            tags |= {(v.tag, v.WhichOneof("value")) for v in e.summary.value}
    return tags


def test_train_writes_everything_and_loss_falls(tmp_path):
    job = tmp_path / "job"
    p = run_main([
        f"--job_log_dir={job}", "--fdl.train.num_steps=40", "--fdl.train.eval_every=20",
        "--fdl.train.checkpoint_every=20", *SMALL
    ])
    out = p.stdout
    for what in ("metrics:", "tensorboard:", "checkpoints:", "plot:"):
        assert what in out, out
    ev = records(job, "eval")
    assert [r["step"] for r in ev] == [0, 20, 40]
    first, last = ev[0]["heldout_loss"], ev[-1]["heldout_loss"]
    # From about ln(256) = 5.5 nats at init; 40 small steps learn the byte unigram and more.
    assert last < first - 1.5, (first, last)
    assert abs(ev[-1]["heldout_perplexity"] - np.exp(last)) < 1e-3 * np.exp(last)
    tr = records(job, "train")
    assert [r["step"] for r in tr] == list(range(1, 41))
    assert all(r["tokens_per_sec"] > 0 and r["grad_norm"] > 0 for r in tr)
    assert all(0 < r["aux_loss"] < 1 for r in tr)  # the MoE aux loss reached total_loss
    # each MoE layer's balance, max / mean of its expert load, between 1 and E = 8
    assert all(1 <= r[f"max_mean_load_layer_{l}"] <= 8 for r in tr for l in (0, 1))
    # each MoE layer's router entropy, in [0, ln 8]; the run's router_entropy is their mean
    assert all(0 <= r[f"router_entropy_layer_{l}"] <= np.log(8) + 1e-5 for r in tr for l in (0, 1))
    np.testing.assert_allclose([r["router_entropy"] for r in tr],
                               [(r["router_entropy_layer_0"] + r["router_entropy_layer_1"]) / 2
                                for r in tr],
                               rtol=1e-5)
    np.testing.assert_allclose([r["loss"] - r["xent"] for r in tr], [r["aux_loss"] for r in tr],
                               rtol=1e-4,
                               atol=1e-6)
    loads = records(job, "expert_load")
    assert loads and np.asarray(loads[-1]["load"]).shape == (2, 8)
    # each layer's per-expert fractions of routed copies sum to 1
    np.testing.assert_allclose(np.asarray(loads[-1]["load"]).sum(-1), 1.0, rtol=1e-5)
    assert (job / "summary.png").read_bytes()[:4] == b"\x89PNG"
    tags = _tensorboard_tags(job / "tensorboard")
    assert {("train/loss", "simple_value"), ("train/tokens_per_sec", "simple_value"),
            ("train/aux_loss", "simple_value"), ("eval/heldout_loss", "simple_value"),
            ("eval/heldout_perplexity", "simple_value"), ("expert_load/load", "image"),
            ("train/max_mean_load_layer_1", "simple_value"),
            ("train/router_entropy_layer_1", "simple_value")} <= tags
    assert sorted(int(d.name) for d in (job / "checkpoints").iterdir()
                  if d.name.isdigit()) == [20, 40]
    # --mode=eval restores the latest checkpoint and gets the last eval's numbers back.
    p = run_main([f"--job_log_dir={job}", "--mode=eval", *SMALL])
    got = json.loads(p.stdout[p.stdout.index("\n{") + 1:])
    assert got["step"] == 40
    assert abs(got["heldout_loss"] - last) <= 1e-6 * abs(last)
    # Running again does nothing: the run is complete.
    p = run_main([f"--job_log_dir={job}", "--fdl.train.num_steps=40", *SMALL])
    assert "nothing to do" in p.stdout
    # A different model in the same job_log_dir: a clear error, not a stack trace. The
    # recorded config refuses it first; let in, its checkpoints do not restore into it.
    p = run_main(
        [f"--job_log_dir={job}", "--fdl.model.stacked_transformer_tpl.num_experts=4", *SMALL],
        check=False)
    assert p.returncode == 2
    assert "model.stacked_transformer_tpl.num_experts: 8 -> 4" in p.stderr
    p = run_main([
        f"--job_log_dir={job}", "--fdl.model.stacked_transformer_tpl.num_experts=4",
        "--allow_config_change", *SMALL
    ],
                 check=False)
    assert p.returncode == 2
    assert "the checkpoint of step 40" in p.stderr and "does not fit" in p.stderr


def _docs_commands_on_runs_tiny() -> list[list[str]]:
    """The arguments of every `python -m experiments.main` command in README.md and
    docs/experiments.md that reads runs/tiny (the job `make run` makes), backslash-continued
    lines joined, comments left out."""
    found = []
    for doc in ("README.md", "docs/experiments.md"):
        text = (ROOT / doc).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            if re.match(r"(\.venv/bin/)?python -m experiments\.main ", line) and \
                    "--job_log_dir=runs/tiny" in line:
                found.append(shlex.split(line)[3:])
    return found


def test_the_docs_eval_and_sample_commands_run_on_a_trained_tiny_job(tmp_path):
    """Each eval and sample command of the README and docs/experiments.md, and the docs'
    ``generate`` example, runs as written on a Tiny job (its context of 64 tokens: the
    README's sample command takes --max_new_tokens's default, what fits), trained 2 steps."""
    cache = tmp_path / "compile_cache"
    job = tmp_path / "runs" / "tiny"
    run_main([
        f"--job_log_dir={job}", "--fdl.train.num_steps=2", "--fdl.train.eval_every=2",
        "--fdl.train.eval_batches=1", "--fdl.data.batch_size=8", "--no_progress"
    ],
             compile_cache=cache)
    commands = _docs_commands_on_runs_tiny()
    modes = sorted(a for c in commands for a in c if a.startswith("--mode="))
    assert modes == ["--mode=eval", "--mode=sample", "--mode=sample"], commands
    for args in commands:
        args = [a.replace("runs/tiny", str(job)) for a in args]
        p = run_main(args, compile_cache=cache)
        if "--mode=eval" in args:
            assert json.loads(p.stdout[p.stdout.index("\n{") + 1:])["step"] == 2
        else:
            assert "=== prompt 0: 'def main('" in p.stdout and "tokens/s" in p.stdout, p.stdout
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/experiments.md").read_text(), re.S)
    [block] = [b for b in blocks if 'generate("runs/tiny"' in b]
    p = subprocess.run(
        [sys.executable, "-c", block.replace("runs/tiny", str(job))],
        cwd=ROOT,
        env=main_env(1, cache),
        capture_output=True,
        text=True,
        timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    texts = ast.literal_eval(p.stdout.strip().splitlines()[-1])
    assert len(texts) == 1 and len(texts[0]) == 2 and all(isinstance(t, str) for t in texts[0])


def test_sigterm_and_resume_reproduce_the_uninterrupted_losses(tmp_path):
    common = [
        "--fdl.train.num_steps=120", "--fdl.train.eval_every=60", "--fdl.train.checkpoint_every=50",
        *SMALL
    ]
    ref = tmp_path / "ref"
    run_main([f"--job_log_dir={ref}", *common])
    job = tmp_path / "job"
    p = run_main([f"--job_log_dir={job}", "--fdl.train.sigterm_at_step=60", *common], check=False)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    assert "stopped by SIGTERM at step 60" in p.stdout
    assert 60 in [int(d.name) for d in (job / "checkpoints").iterdir() if d.name.isdigit()]
    assert max(r["step"] for r in records(job, "train")) == 60
    # the resumed start evaluates the restored state first (train.eval_on_restore, a loop field)
    p = run_main([f"--job_log_dir={job}", "--fdl.train.eval_on_restore=True", *common])
    got = {r["step"]: r["loss"] for r in records(job, "train")}
    want = {r["step"]: r["loss"] for r in records(ref, "train")}
    assert sorted(got) == list(range(1, 121)) == sorted(want)
    # Bitwise on the CPU: same batches from (seed, step), same state from the checkpoint; the
    # extra evaluation changes nothing the steps compute.
    assert [got[s] for s in range(1, 121)] == [want[s] for s in range(1, 121)]
    e_want = {r["step"]: r["heldout_loss"] for r in records(ref, "eval")}
    assert {r["step"]: r["heldout_loss"] for r in records(job, "eval")} == e_want
    # every eval line, not read_metrics' last per step: step 60 before the stop, and restored
    lines = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r["step"], r["heldout_loss"]) for r in lines if r["kind"] == "eval"]
    assert [s for s, _ in evals] == [0, 60, 60, 120] and evals[1] == evals[2]
    assert f"held-out loss {e_want[60]:.4f} at step 60 -> {e_want[120]:.4f} at step 120" in p.stdout


VALIDATE = r"""
import json, sys
from configs import experiments
from experiments import validate
out = {}
for name in sys.argv[1:]:
    out[name] = validate.validate(getattr(experiments, name)())
print(json.dumps(out))
"""


def test_gpu_presets_trace_on_fake_devices():
    """eval_shape of init and one train step of every GPU-scale preset on its own mesh of fake
    CPU devices (no allocation, no compilation), expert-parallel MoE path included."""
    p = subprocess.run(
        [sys.executable, "-c", VALIDATE, "small_gpu", "mixtral_8x7b", "deepseek_v3", "qwen3_moe"],
        cwd=ROOT,
        env=main_env(256),
        capture_output=True,
        text=True,
        timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    h200 = 141e9
    sg, mx, ds, qw = rep["small_gpu"], rep["mixtral_8x7b"], rep["deepseek_v3"], rep["qwen3_moe"]
    assert sg["mesh"] == {"data": 1}
    assert mx["mesh"] == {"data": 2, "fsdp": 4, "expert": 8}
    assert ds["mesh"] == {"data": 1, "fsdp": 8, "expert": 32}
    assert qw["mesh"] == {"data": 1, "fsdp": 4, "expert": 8}

    # Parameter counts from the layer shapes, written out independently:
    def lm_params(v, m, layers, heads, dh, e, h_moe, dense=0, h=0, shared=0, kv=None, qk=0):
        kv = kv or heads  # key/value heads; qk: the query/key norms' scales of a layer
        # q,k,v,o weights + q,k,v and o biases + the q/k norms
        attn = 2 * m * heads * dh + 2 * m * kv * dh + (heads + 2 * kv) * dh + m + qk
        # router + gate/up/down + the shared experts' gate/up/down (the expert bias is
        # non-trainable: not a parameter)
        moe = m * e + 3 * e * m * h_moe + 3 * m * shared
        ffn = 3 * m * h + 2 * h + m  # a dense layer's gated FFN with its biases
        norms = 2 * m
        return (v * m + v + dense * (attn + ffn + norms) + (layers - dense) * (attn + moe + norms) +
                m)  # tied emb, logit bias, final norm

    assert mx["num_params"] == lm_params(32000, 4096, 32, 32, 128, 8, 14336, kv=8)
    # DeepSeek-V3: 3 dense layers (H=18432), 1 shared expert of 2048
    assert ds["num_params"] == lm_params(129280, 7168, 61, 128, 128, 256, 2048, 3, 18432, 2048)
    assert ds["num_params"] == 687_345_360_128  # docs/experiments.md
    assert qw["num_params"] == lm_params(151936, 2048, 48, 32, 128, 128, 768, kv=4, qk=2 * 128)
    assert sg["num_params"] == lm_params(256, 1024, 8, 16, 64, 8, 2048)
    for r in (mx, ds, qw):
        assert r["loss"] == [[], "float32"]
        # parameters + Adam moments (fp32) sharded by the preset's mesh fit on one H200
        assert r["state_bytes_per_device"] < 0.6 * h200, r
    assert mx["expert_load_shape"] == [32, 8] and ds["expert_load_shape"] == [61, 256]
    assert qw["expert_load_shape"] == [48, 128]


def test_expert_parallel_meshes_train_like_data_parallel():
    """The same Tiny steps on dp8 and on dp2 x fsdp2 x ep2 (8 CPU devices, in-process): the
    MoE layer runs expert-parallel through MeshResources and gives the same losses."""

    assert jax.device_count() == 8

    def losses(mesh):
        cfg = experiments.tiny()
        cfg.data.batch_size, cfg.data.seq_len = 8, 32
        experiments.use_mesh(cfg, mesh)
        prep = setup.prepare(cfg)
        fns = steps.make_step_fns(prep)
        ds = data_lib.load_dataset(prep.config.data)
        out = []
        with jax.set_mesh(prep.mesh):
            state = fns.init(jax.random.key(0))
            for step in range(3):
                state, m = fns.train(state, steps.put_batch(ds.train_batch(step),
                                                            fns.batch_sharding))
                out.append([float(m["loss"]), float(m["aux_loss"])])
        return np.array(out), prep

    a, _ = losses(meshes.data_parallel())
    b, prep = losses(meshes.fsdp_expert_parallel(2, 2, 2))
    moe = prep.model_config.stacked_transformer_tpl.moe_layer_tpl
    assert moe.mesh_resources.ep == "expert"
    # float32, different reduction orders over 3 Adam steps
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-6)


def test_cli_errors_exit_2_with_the_message_and_write_nothing(tmp_path):
    job = tmp_path / "job"
    p = run_main(["--exp=tiny_synthtic", f"--job_log_dir={job}"], check=False, timeout=120)
    assert p.returncode == 2
    assert "experiments.main: error: --exp='tiny_synthtic' is not a registered experiment; " \
        "did you mean tiny_synthetic (configs.experiments.TinySynthetic)" in p.stderr
    p = run_main(["--fdl.train.num_stepz=3", f"--job_log_dir={job}"], check=False, timeout=120)
    assert p.returncode == 2 and "did you mean num_steps" in p.stderr
    p = run_main(["--fdl.data.batch_size=12", f"--job_log_dir={job}"],
                 devices=8,
                 check=False,
                 timeout=120)
    assert p.returncode == 2 and "invalid config: --fdl.data.batch_size=12" in p.stderr
    assert not job.exists()


def _wait_for_step(job, proc, step, timeout=180):
    path = Path(job) / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"exited early: {proc.communicate()[1][-3000:]}")
        if path.exists() and any('"kind": "train"' in l and f'"step": {step},' in l
                                 for l in path.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_external_sigint_saves_the_step_in_flight(tmp_path):
    """A signal from outside (here a user's Ctrl-C; SIGTERM takes the same handler, tested
    above): the step in flight finishes, its state is checkpointed, the exit status is
    128 + signal; a restart resumes from exactly that step."""
    sig = signal.SIGINT
    job = tmp_path / "job"
    args = [
        f"--job_log_dir={job}", "--fdl.train.num_steps=100000", "--fdl.train.eval_every=1000",
        "--fdl.train.checkpoint_every=0", *SMALL
    ]
    p = subprocess.Popen([sys.executable, "-m", "experiments.main", *args],
                         cwd=ROOT,
                         env=main_env(1),
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         text=True)
    _wait_for_step(job, p, 3)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-3000:]
    last = max(r["step"] for r in records(job, "train"))
    assert f"stopped by {signal.Signals(sig).name} at step {last}" in out
    assert [int(d.name) for d in (job / "checkpoints").iterdir() if d.name.isdigit()] == [last]
    p = run_main([f"--job_log_dir={job}", f"--fdl.train.num_steps={last + 2}", *SMALL])
    steps = [r["step"] for r in records(job, "train")]
    assert steps == list(range(1, last + 3))
