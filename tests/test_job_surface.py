"""What the job does around its steps: stop signals from the first
line of main (at once during start-up and at a second signal, after a save otherwise),
--fdl_help and --list_experiments instead of running, tokens/s of the step alone, the MoE
router statistics in the metrics and TensorBoard, a readable expert-load image, and a step-0
loss near ln(vocab) for every preset."""

import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import experiments, registry
from experiments.train import loop, metrics, setup, signals
from experiments import main
from tests.flagutil import parse as _parse
from tests.flagutil import reset_flags  # noqa: F401  (autouse)

ROOT = Path(__file__).resolve().parents[1]


def _env(devices: int = 1) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ------------------------------------------------------------------------------ signals

_SIGNAL_SCRIPT = """
    import os, signal, sys, time
    from experiments.train.signals import StopSignals
    with StopSignals() as s:
        if sys.argv[1] == "startup":
            print("READY", flush=True)
            time.sleep(120)  # a long call into C (as a compile is): no Python code runs
        else:
            s.training()
            os.kill(os.getpid(), signal.SIGINT)
            print("REQUESTED", s.stop_requested, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            print("NOT REACHED", flush=True)
    print("END", flush=True)
"""


def _popen(args, **kw):
    return subprocess.Popen(args,
                            cwd=ROOT,
                            env=_env(),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            **kw)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_startup_ends_the_process_at_once(sig):
    p = _popen([sys.executable, "-c", textwrap.dedent(_SIGNAL_SCRIPT), "startup"])
    assert p.stdout.readline().strip() == "READY"
    t0 = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert took < 5.0, took  # the process sleeps 120 s unless the signal ends it
    assert "END" not in out
    assert f"stopped by {signal.Signals(sig).name} during start-up" in err, err


def test_in_training_the_first_signal_asks_a_stop_and_a_second_ends_at_once():
    p = _popen([sys.executable, "-c", textwrap.dedent(_SIGNAL_SCRIPT), "training"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)
    assert "REQUESTED SIGINT" in out and "NOT REACHED" not in out and "END" not in out, out
    assert "a second stop signal (SIGINT)" in err, err


def test_exit_status_is_128_plus_the_signal():
    assert signals.exit_status(signal.SIGTERM) == 143
    assert signals.exit_status(signal.SIGINT) == 130


@pytest.mark.slow
def test_sigterm_during_the_compile_of_main_ends_it_within_seconds(tmp_path):
    """SIGTERM while XLA compiles the train step of `python -m experiments.main` (a 16-layer
    Tiny, whose compile takes far longer than the limit): exit 143 within seconds, before the
    compile finishes, nothing trained or saved."""
    job = tmp_path / "job"
    env = _env()
    env["JAX_LOG_COMPILES"] = "1"  # JAX logs the end of lowering and of the XLA compile
    p = subprocess.Popen([
        sys.executable, "-m", "experiments.main", f"--job_log_dir={job}", "--no_progress",
        "--fdl.model.stacked_transformer_tpl.num_layers=16", "--fdl.train.num_steps=5"
    ],
                         cwd=ROOT,
                         env=env,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         text=True)
    lines = []
    lowered = re.compile(r"Finished jaxpr to MLIR module conversion \S*train_fn")
    try:
        for line in p.stderr:
            lines.append(line)
            if lowered.search(line):  # the XLA compile of the train step starts now
                break
        else:
            pytest.fail(f"the run ended before compiling its train step:\n{''.join(lines)}")
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rest = []
        reader = threading.Thread(target=lambda: rest.extend(p.stderr))
        reader.start()
        p.wait(timeout=120)
        took = time.monotonic() - t0
        reader.join(timeout=10)
    finally:
        p.kill()
    err = "".join(lines + rest)
    assert p.returncode == 143, (p.returncode, err[-3000:])
    assert took < 5.0, took
    assert not re.search(r"Finished XLA compilation of \S*train_fn", err), err[-3000:]
    assert "stopped by SIGTERM during start-up" in err
    assert not (job / "checkpoints").exists() or not any((job / "checkpoints").iterdir())


# ------------------------------------------------------------- --fdl_help, --list_experiments


def _no_run(monkeypatch):

    def fail(*a, **k):
        raise AssertionError("the job ran")

    monkeypatch.setattr(setup, "prepare", fail)


@pytest.mark.parametrize("how", [["--exp=tiny"], ["--fdl_config=tiny"]])
def test_fdl_help_prints_the_experiments_help_instead_of_running(how, monkeypatch, capsys):
    _no_run(monkeypatch)
    _parse(*how, "--fdl_help", "--fdl.train.num_steps=7")
    assert main.main(["main"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("experiment tiny")
    if how[0].startswith("--exp"):
        assert "(configs.experiments.Tiny)" in out and "2 MoE layers" in out
    for flag in ("--exp:", "--job_log_dir:", "--[no]list_experiments", "--fdl_config:",
                 "--fiddler:"):
        assert flag in out, flag
    assert "train.num_steps = 7" in out  # the overrides applied
    assert "data.batch_size = 16" in out


@pytest.mark.parametrize("exp,at", [("tiny", "model.stacked_transformer_tpl"),
                                    ("deepseek_v3", "model.stacked_transformer_tpl.block")])
def test_fdl_help_marks_the_template_fields_the_stack_sets(exp, at, monkeypatch, capsys):
    """--fdl_help shows the MoE template's num_experts / gating_func / ... (which the stack
    overwrites) with the value the layers get and where it is set; other fields unmarked."""
    _no_run(monkeypatch)
    _parse(f"--exp={exp}", "--fdl_help", f"--fdl.{at}.num_experts=4")
    assert main.main(["main"]) == 0
    lines = {
        ln.split(" = ", 1)[0]: ln
        for ln in capsys.readouterr().out.splitlines() if " = " in ln
    }
    tpl = f"{at}.moe_layer_tpl"
    assert lines[f"{tpl}.num_experts"].endswith(f"# set by the stack: 4 from {at}.num_experts")
    gating = lines[f"{tpl}.gating_func"]
    assert "default: 'top2'" in gating and gating.endswith(
        f"# set by the stack: 'topk' from {at}.gating_func")
    assert "# set by the stack: " in lines[f"{tpl}.input_dims"]
    assert "set by the stack" not in lines[f"{tpl}.num_experts_per_token"]
    assert "set by the stack" not in lines[f"{at}.num_experts"]


def test_validate_prints_only_its_answer():
    """python -m experiments.validate without JAX_PLATFORMS (JAX probes for a TPU and logs at
    INFO that libtpu is missing): stdout is the JSON report and stderr has no absl INFO line."""
    env = _env(1)
    env.pop("JAX_PLATFORMS", None)
    p = subprocess.run([sys.executable, "-m", "experiments.validate", "--exp=tiny"],
                       cwd=ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["experiment"] == "tiny"
    info = [ln for ln in p.stderr.splitlines() if re.match(r"I\d{4} ", ln)]
    assert not info, info


def test_list_experiments(monkeypatch, capsys):
    _no_run(monkeypatch)
    _parse("--list_experiments")
    assert main.main(["main"]) == 0
    out = capsys.readouterr().out
    for full, cls in registry.all_experiments().items():
        line = next(ln for ln in out.splitlines() if full in ln)
        assert line.split()[0] == registry.short_name(cls)
        # every listed name resolves to its experiment
        assert registry.get_experiment(line.split()[0]) is cls


# ------------------------------------------------------------------ metrics and TensorBoard


def test_moe_scalars_are_means_over_stacked_and_repeated_layers():
    rng = np.random.default_rng()
    a, b = rng.random(3), rng.random((4, 3))  # two stacked layers; a repeat of 4
    stacked = {
        "lm": {
            "transformer": {
                f"x_layers_{i}": {
                    "moe": {
                        "moe_router_entropy_scalar": a[i],
                        "moe_dropped_token_fraction_scalar": a[i] / 10,
                        "moe_z_loss_scalar": a[i] + 1,
                        "moe_expert_load_0_scalar": 1.0,
                    }
                }
                for i in range(2)
            }
        }
    }
    got = {k: float(v) for k, v in metrics.moe_scalars(stacked).items()}
    np.testing.assert_allclose(
        [got["router_entropy"], got["dropped_token_fraction"], got["z_loss"]],
        [a[:2].mean(), a[:2].mean() / 10, a[:2].mean() + 1],
        rtol=1e-6)
    repeated = {"repeat": {"sub": {"x_layers_0": {"moe": {"moe_router_entropy_scalar": b[:, 0]}}}}}
    got = metrics.moe_scalars(repeated)
    assert list(got) == ["router_entropy"]
    np.testing.assert_allclose(float(got["router_entropy"]), b[:, 0].mean(), rtol=1e-6)
    assert metrics.moe_scalars({"lm": {"x": {"other_scalar": 1.0}}}) == {}


@pytest.mark.parametrize("shape,factor", [((2, 8), 128), ((61, 256), 4), ((32, 8), 32),
                                          ((1, 2000), 1)])
def test_expert_load_image_is_upscaled_in_blocks(shape, factor):
    img = np.random.default_rng().random(shape).astype(np.float32)
    big = metrics.upscale(img)
    assert big.shape == (shape[0] * factor, shape[1] * factor)
    np.testing.assert_array_equal(big[::factor, ::factor], img)
    np.testing.assert_array_equal(big, np.kron(img, np.ones((factor, factor), np.float32)))


def _tensorboard_values(tb_dir):
    """{tag: [value proto, ...]} of the event files (TFRecord framing: length u64, crc u32,
    Event proto, crc u32)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for f in Path(tb_dir).glob("events.out.tfevents.*"):
        b, i = f.read_bytes(), 0
        while i < len(b):
            n = struct.unpack("<Q", b[i:i + 8])[0]
            e = event_pb2.Event()
            e.ParseFromString(b[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in e.summary.value:
                out.setdefault(v.tag, []).append(v)
    return out


@pytest.mark.slow
def test_tiny_run_step_time_router_statistics_image_and_initial_loss(tmp_path, monkeypatch):
    """Tiny as `make run` has it, 3 steps with an eval and a checkpoint after each, each made
    3 s slower: tokens/s is the step's own; the router statistics reach metrics.jsonl and
    TensorBoard; the expert-load image is at least 256 pixels high; the step-0 held-out loss is
    within 10% of ln 256."""
    delay = 3.0
    evaluate, save = loop.Trainer._evaluate, loop.Trainer._save

    def slow_evaluate(self, *a):
        time.sleep(delay)
        return evaluate(self, *a)

    def slow_save(self, *a):
        time.sleep(delay)
        return save(self, *a)

    monkeypatch.setattr(loop.Trainer, "_evaluate", slow_evaluate)
    monkeypatch.setattr(loop.Trainer, "_save", slow_save)
    cfg = experiments.tiny()
    cfg.mesh.shape = (1, )
    cfg.train.num_steps, cfg.train.eval_every, cfg.train.checkpoint_every = 3, 1, 1
    cfg.train.summary_every = 1
    cfg.model.stacked_transformer_tpl.moe_layer_tpl.router_z_loss_weight = 1e-3  # Tiny's is 0
    prep = setup.prepare(cfg, devices=jax.devices()[:1])
    result = loop.Trainer(prep, tmp_path, progress=False).run()
    assert result["final_step"] == 3

    # The step-0 held-out loss of Tiny's own evaluation: near a uniform guess over 256 bytes.
    first = result["first_eval"]["heldout_loss"]
    assert abs(first - math.log(256)) <= 0.1 * math.log(256), first

    recs = [r for r in metrics.read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [1, 2, 3]
    tokens = cfg.data.batch_size * cfg.data.seq_len
    for r in recs:
        # steps 2 and 3 follow an eval and a checkpoint (3 s each) that must not count (a step
        # of Tiny takes a fraction of a second, on a loaded machine too)
        assert tokens / r["tokens_per_sec"] < delay, r
        assert 0.0 < r["router_entropy"] <= math.log(8) + 1e-5, r  # 8 experts
        assert r["dropped_token_fraction"] == 0.0, r  # 'topk' is dropless
        assert r["z_loss"] > 0.0, r  # the coefficient applied
    tb = _tensorboard_values(tmp_path / "tensorboard")
    for k in ("router_entropy", "dropped_token_fraction", "z_loss"):
        got = [v.simple_value for v in tb[f"train/{k}"]]
        np.testing.assert_allclose(got, [r[k] for r in recs], rtol=1e-6)
    img = tb["expert_load/load"][-1].image
    assert (img.height, img.width) == (256, 1024)  # 2 layers x 8 experts, 128-pixel blocks


# ------------------------------------------------------------------- initial loss, presets


def _step0_loss(model_cfg, batch: int, seq: int, seed: int) -> float:
    """Held-out-style cross-entropy of a freshly initialised LM on uniform random bytes (a
    uniform guess scores ln V on any data; jitted init and apply, no eval_shape)."""
    from praxis import base_layer, pax_fiddle, py_utils

    model = pax_fiddle.build(model_cfg)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 256, (batch, seq)), jnp.int32)
    labels = py_utils.NestedMap(class_ids=jnp.asarray(rng.integers(0, 256, (batch, seq)),
                                                      jnp.int32),
                                class_weights=jnp.ones((batch, seq), jnp.float32))
    paddings = jnp.zeros((batch, seq), jnp.float32)

    @jax.jit
    def loss(key):
        k1, k2 = jax.random.split(key)
        variables = model.init({
            base_layer.PARAMS: k1,
            base_layer.RANDOM: k2
        },
                               ids,
                               paddings,
                               labels=labels)
        ctx = base_layer.JaxContext.HParams(do_eval=True)
        with base_layer.JaxContext.new_context(hparams=ctx):
            out = model.apply(variables, ids, paddings, labels=labels)
        return out.avg_xent

    return float(loss(jax.random.key(seed)))


def _narrow(cls):
    """The preset with its vocabulary, dtype, stack kind and MoE layer options, but one layer
    of M=64 (so no dense-first layers): the initial loss depends on the embedding, the output
    layer and the final norm."""
    return type(
        f"Narrow{cls.__name__}",
        (cls, ),
        dict(
            VOCAB_SIZE=cls.VOCAB_SIZE or 256,
            NUM_LAYERS=1,
            MODEL_DIMS=64,
            HIDDEN_DIMS=64,
            MOE_HIDDEN_DIMS=None,
            NUM_HEADS=4,
            # grouped-query presets keep grouped-query attention: 2 key/value heads of the 4
            NUM_KV_HEADS=2 if getattr(cls, "NUM_KV_HEADS", None) else None,
            DIM_PER_HEAD=None,
            # group-limited presets (8 groups top-4) need k >= 4 and 2 experts a group
            NUM_EXPERTS=16 if cls.GROUP_TOPK > 1 else 8,
            TOP_K=8 if cls.GROUP_TOPK > 1 else 2,
            FIRST_K_DENSE=0))


@pytest.mark.parametrize("cls", experiments.GPU_PRESETS, ids=lambda c: c.__name__)
def test_every_presets_step0_loss_is_near_ln_vocab(cls):
    vocab = cls.VOCAB_SIZE or 256  # None: the tokenizer's (bytes)
    got = _step0_loss(_narrow(cls)().model(), 2, 16, np.random.default_rng().integers(1 << 30))
    assert abs(got - math.log(vocab)) <= 0.1 * math.log(vocab), (got, math.log(vocab))


@pytest.mark.slow
def test_small_gpu_step0_loss_on_a_few_tokens_is_near_ln_256():
    """SmallGpu itself (8 layers, M=1024, bf16; 0.44B parameters, 1.7 GB in float32) on the
    CPU: 2 x 16 tokens through the real init and forward pass."""
    # the vocabulary is the job's tokenizer's (bytes: 256), set here as the runner would
    small_gpu = type("SmallGpuBytes", (experiments.SmallGpu, ), dict(VOCAB_SIZE=256))
    got = _step0_loss(small_gpu().model(), 2, 16, np.random.default_rng().integers(1 << 30))
    assert abs(got - math.log(256)) <= 0.1 * math.log(256), got
