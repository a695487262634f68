"""A run that can be trusted: a non-finite loss, gradient norm or state stops the run (or, with
train.on_nonfinite='skip', leaves the state as it was) before anything non-finite is saved, and
resume takes the newest checkpoint that restores, passing over damaged ones with one line each.

The unit tests use a small state on one CPU device; the end-to-end tests run
`python -m experiments.main` on the Tiny model (8 x 32-byte batches) in subprocesses."""

import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from experiments.train import setup
from experiments.train.checkpoints import DAMAGED_DIR, Checkpoints, NonFiniteState
from tests.main_util import SMALL, records, run_main

# A learning rate this large turns the parameters into ~1e30 after step 1; step 2's loss and
# gradient norm are NaN on any initialisation.
DIVERGE = [
    "--fdl.optimizer.learning_rate=1e30", "--fdl.optimizer.clip_norm=0.0",
    "--fdl.optimizer.warmup_steps=0"
]

# ----------------------------------------------------------------------------- config fields


@pytest.mark.parametrize("field, value, pattern", [
    ("on_nonfinite", "ignore", r"TrainConfig.on_nonfinite='ignore' is invalid: valid: \('stop', "
     r"'skip'\)"),
    ("max_skipped_steps", -1, r"TrainConfig.max_skipped_steps=-1 is invalid: must be an int >= 0"),
])
def test_nonfinite_policy_fields_are_validated(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        base.TrainConfig(**{field: value})
    assert base.TrainConfig().on_nonfinite == "stop"


@pytest.mark.parametrize("field", ["cast_weights_once", "eval_on_restore"])
def test_the_train_switches_take_only_bools(field):
    with pytest.raises(ValueError,
                       match=rf"TrainConfig.{field}=1 is invalid: must be True or False"):
        base.TrainConfig(**{field: 1})


# --------------------------------------------------------------------- checkpoints, in-process


def _state(scale=1.0):
    rng = np.random.default_rng()
    return {
        "step": jnp.int32(3),
        "params": {
            "w": jnp.asarray(rng.standard_normal((4, 3)) * scale, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32)
        },
        # a tuple, as optax states are: without _METADATA orbax cannot tell it from a list
        "opt_state": (jnp.asarray(rng.standard_normal((4, 3)), jnp.float32), {
            "count": jnp.int32(3)
        }),
    }


def _checkpoints(tmp_path, max_to_keep=5):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data", ))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), _state())
    return Checkpoints(tmp_path / "checkpoints", max_to_keep, abstract)


def _save_raw(ckpts, state, step):
    """Writes a checkpoint with orbax directly, past the finiteness check of ``save``."""
    import orbax.checkpoint as ocp

    mngr = ckpts.manager()
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    mngr.close()


def _truncate_data_files(step_dir: Path) -> int:
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(10)
    return len(files)


def test_save_refuses_a_non_finite_state_and_writes_nothing(tmp_path):
    ckpts = _checkpoints(tmp_path)
    mngr = ckpts.manager()
    good = _state()
    ckpts.save(mngr, good, 1)
    bad = _state()
    bad["params"]["b"] = bad["params"]["b"].at[1].set(jnp.inf)
    bad["opt_state"] = (bad["opt_state"][0].at[0, 0].set(jnp.nan), bad["opt_state"][1])
    with pytest.raises(NonFiniteState,
                       match=r"the state of step 2 holds non-finite values in "
                       r"\['opt_state'\]\[0\], \['params'\]\['b'\]; it was not saved"):
        ckpts.save(mngr, bad, 2)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1]
    mngr.close()
    assert sorted(p.name for p in ckpts.ckpt_dir.iterdir() if p.name.isdigit()) == ["1"]


def _restore(ckpts, set_aside=True):
    mngr = ckpts.manager()
    try:
        return ckpts.restore_newest(mngr, set_aside=set_aside)
    finally:
        mngr.close()


def _assert_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_passes_over_damaged_and_non_finite_checkpoints(tmp_path):
    ckpts = _checkpoints(tmp_path)
    states = {s: _state() for s in (10, 20, 30, 40)}
    for s, st in states.items():
        _save_raw(ckpts, st, s)
    d = ckpts.ckpt_dir
    assert _truncate_data_files(d / "40") > 0
    (d / "30" / "default" / "_METADATA").unlink()
    nan_state = _state()
    nan_state["params"]["w"] = nan_state["params"]["w"].at[2, 1].set(jnp.nan)
    shutil.rmtree(d / "20")
    _save_raw(ckpts, nan_state, 20)  # written by code that did not check

    # --mode=eval: the same choice, nothing moved
    state, step, notes = _restore(ckpts, set_aside=False)
    assert step == 10 and len(notes) == 3
    assert sorted(p.name for p in d.iterdir()) == ["10", "20", "30", "40"]

    state, step, notes = _restore(ckpts)
    assert step == 10
    _assert_equal(state, states[10])
    assert len(notes) == 3 and all("\n" not in n for n in notes)
    assert notes[0].startswith(f"checkpoint 40 in {d} does not restore (data file ")
    assert "is truncated: 10 bytes" in notes[0]
    assert notes[1].startswith(f"checkpoint 30 in {d} does not restore (its _METADATA file is "
                               "missing")
    assert notes[2].startswith(f"checkpoint 20 in {d} does not restore (it holds non-finite "
                               "values in ['params']['w'])")
    damaged = tmp_path / DAMAGED_DIR
    for n, s in zip(notes, (40, 30, 20)):
        assert n.endswith(f"; moved to {damaged / str(s)}; skipped"), n
    assert sorted(p.name for p in d.iterdir()) == ["10"]
    assert sorted(p.name for p in damaged.iterdir()) == ["20", "30", "40"]
    # The run can write those steps again.
    mngr = ckpts.manager()
    ckpts.save(mngr, states[20], 20)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [10, 20]
    mngr.close()


def test_a_truncated_array_chunk_is_reported_by_its_reason(tmp_path):
    """An array large enough to be read as a chunk of its own, its data cut short: orbax wraps
    the read's error in one whose text is the TensorStore spec; the line says the reason (the
    chunk, its file, the sizes), not that spec's repr."""
    import orbax.checkpoint as ocp

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data", ))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jnp.asarray(np.random.default_rng().standard_normal((256, 256)), jnp.float32)}
    abstract = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rep)}
    ckpts = Checkpoints(tmp_path / "checkpoints", 3, abstract)
    _save_raw(ckpts, state, 20)
    data = max((f for f in (ckpts.ckpt_dir / "20").rglob("*") if f.parent.name == "d"),
               key=lambda f: f.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as fh:
        fh.truncate(size - 1000)
    mngr = ckpts.manager()
    with pytest.raises(Exception, match="TensorStore details"):  # what orbax raises
        mngr.restore(20, args=ocp.args.StandardRestore(abstract))
    state, why = ckpts._try_restore(mngr, 20)
    mngr.close()
    assert state is None
    assert why.startswith(f"array chunk w/0.0 in {ckpts.ckpt_dir / '20'}") and \
        "is truncated" in why and "bound method" not in why, why


def test_no_checkpoint_restores_is_one_line(tmp_path):
    ckpts = _checkpoints(tmp_path)
    assert _restore(ckpts) == (None, None, [])  # no checkpoint: the caller initialises
    for s in (1, 2):
        _save_raw(ckpts, _state(), s)
        _truncate_data_files(ckpts.ckpt_dir / str(s))
    with pytest.raises(setup.ConfigError) as e:
        _restore(ckpts)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 1000, msg
    assert msg.startswith(f"no checkpoint in {ckpts.ckpt_dir} restores: the checkpoint of step "
                          "2 does not fit this experiment's state or is damaged (data file ")
    assert "the checkpoint of step 1 does not fit" in msg
    # nothing is moved when nothing restores
    assert sorted(p.name for p in ckpts.ckpt_dir.iterdir()) == ["1", "2"]


# ---------------------------------------------------------------------------- end to end


def _stored_steps(job) -> list[int]:
    return sorted(int(p.name) for p in (Path(job) / "checkpoints").iterdir() if p.name.isdigit())


def _read_checkpoint(job, step):
    """The arrays of a checkpoint as orbax reads them without a target (numpy)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as c:
        return c.restore(Path(job) / "checkpoints" / str(step) / "default")


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("experiments.main: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_diverging_run_stops_before_saving_non_finite_state(tmp_path):
    """The issue's command (learning rate 1000, no clipping, no warmup), shortened: it used to
    train on NaN to the end, checkpoint NaN parameters and exit 0."""
    job = tmp_path / "nan"
    opt = [
        "--fdl.optimizer.learning_rate=1000.0", "--fdl.optimizer.clip_norm=0.0",
        "--fdl.optimizer.warmup_steps=0"
    ]
    p = run_main([
        f"--job_log_dir={job}", *opt, "--fdl.train.num_steps=30", "--fdl.train.checkpoint_every=2",
        "--fdl.train.eval_every=100", *SMALL
    ],
                 check=False)
    assert p.returncode == 3, p.stderr[-3000:]
    line = _error_line(p.stderr)
    tr = records(job, "train")
    bad = tr[-1]["step"]
    assert not (math.isfinite(tr[-1]["loss"]) and math.isfinite(tr[-1]["grad_norm"]))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in tr[:-1])
    assert 1 < bad < 30
    assert line.startswith(f"experiments.main: error: step {bad}: ")
    assert "not finite" in line and "train.on_nonfinite='stop'" in line
    steps = _stored_steps(job)
    assert steps and max(steps) < bad and max(steps) == 2 * ((bad - 1) // 2)
    assert line.endswith(f"the newest checkpoint is step {max(steps)} in {job / 'checkpoints'}")
    for s in steps:
        leaves = jax.tree_util.tree_leaves(_read_checkpoint(job, s))
        assert all(np.all(np.isfinite(x)) for x in leaves if np.issubdtype(x.dtype, np.inexact))
    # The last good checkpoint restores.
    p = run_main([f"--job_log_dir={job}", "--mode=eval", *opt, *SMALL])
    assert f'"step": {max(steps)}' in p.stdout and "does not restore" not in p.stderr


@pytest.mark.slow
def test_skip_policy_keeps_the_state_and_stops_past_the_limit(tmp_path):
    job = tmp_path / "skip"
    p = run_main([
        f"--job_log_dir={job}", *DIVERGE, "--fdl.train.num_steps=10",
        "--fdl.train.checkpoint_every=1", "--fdl.train.max_checkpoints=10",
        "--fdl.train.eval_every=100", "--fdl.train.on_nonfinite='skip'",
        "--fdl.train.max_skipped_steps=2", *SMALL
    ],
                 check=False)
    assert p.returncode == 3, p.stderr[-3000:]
    tr = {r["step"]: r for r in records(job, "train")}
    # step 1 learns (finite), steps 2, 3, 4 are NaN: skipped, and the third in a row stops
    assert sorted(tr) == [1, 2, 3, 4]
    assert [tr[s]["skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert all(math.isnan(tr[s]["grad_norm"]) for s in (2, 3, 4))
    line = _error_line(p.stderr)
    assert line.startswith("experiments.main: error: step 4: 3 steps in a row skipped, more "
                           "than train.max_skipped_steps=2")
    assert "skipped 3 steps whose loss or gradient norm was not finite" in p.stdout
    assert _stored_steps(job) == [1, 2, 3]
    # A skipped step applies nothing: parameters and optimizer state (with Adam's count) stay.
    c1, c2, c3 = (_read_checkpoint(job, s) for s in (1, 2, 3))
    assert [int(c["step"]) for c in (c1, c2, c3)] == [1, 2, 3]
    assert {"params", "opt_state"} <= set(c1)
    for c in (c2, c3):
        _assert_equal({
            k: v
            for k, v in c.items() if k != "step"
        }, {
            k: v
            for k, v in c1.items() if k != "step"
        })


@pytest.mark.slow
def test_resume_past_damaged_checkpoints_gives_the_uninterrupted_losses(tmp_path):
    common = [
        "--fdl.train.num_steps=12", "--fdl.train.checkpoint_every=4", "--fdl.train.eval_every=100",
        *SMALL
    ]
    ref = tmp_path / "ref"
    run_main([f"--job_log_dir={ref}", *common])
    want = {r["step"]: r["loss"] for r in records(ref, "train")}
    assert _stored_steps(ref) == [4, 8, 12]
    job = tmp_path / "job"
    shutil.copytree(ref, job)
    (job / "metrics.jsonl").unlink()
    ck = job / "checkpoints"
    assert _truncate_data_files(ck / "12") > 0
    (ck / "8" / "default" / "_METADATA").unlink()
    p = run_main([f"--job_log_dir={job}", *common])
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("checkpoint ")]
    assert len(notes) == 2, p.stderr[-3000:]
    assert notes[0].startswith(f"checkpoint 12 in {ck} does not restore (data file ")
    assert notes[1].startswith(f"checkpoint 8 in {ck} does not restore (its _METADATA file is "
                               "missing")
    assert "resumed from the checkpoint of step 4" in p.stdout
    got = {r["step"]: r["loss"] for r in records(job, "train")}
    assert sorted(got) == list(range(5, 13))
    assert [got[s] for s in range(5, 13)] == [want[s] for s in range(5, 13)]  # bitwise (CPU)
    assert _stored_steps(job) == [4, 8, 12]
    assert sorted(p.name for p in (job / DAMAGED_DIR).iterdir()) == ["12", "8"]
    # Every checkpoint damaged: one line, exit 2, nothing moved.
    for s in (4, 8, 12):
        _truncate_data_files(ck / str(s))
    p = run_main([f"--job_log_dir={job}", *common], check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    line = _error_line(p.stderr)
    assert line.startswith(f"experiments.main: error: no checkpoint in {ck} restores: the "
                           "checkpoint of step 12 does not fit")
    assert "Traceback" not in p.stderr and "Event loop is closed" not in p.stderr
    assert _stored_steps(job) == [4, 8, 12]


def test_failed_read_tasks_of_orbax_are_dropped_and_others_kept():
    """asyncio's report of an unawaited orbax read that failed (a damaged checkpoint) is dropped;
    the same report from other code, and other asyncio records, get through."""
    import logging

    from experiments.train import checkpoints as ckpt

    def exc_from(filename):
        ns = {}
        exec(compile("def f():\n    raise ValueError('read failed')\n", filename, "exec"), ns)
        try:
            ns["f"]()
        except ValueError as e:
            return e

    def record(msg, e):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None,
                                 (type(e), e, e.__traceback__))

    task = "Task exception was never retrieved\nfuture: <Task finished>"
    drop = ckpt._DropFailedReadTasks()
    assert not drop.filter(record(task, exc_from("/site-packages/orbax/checkpoint/x.py")))
    assert drop.filter(record(task, exc_from("/site-packages/mylib/x.py")))
    assert drop.filter(record("Unclosed client session", exc_from("/orbax/x.py")))


@pytest.mark.parametrize("pinned_host", [None, False])
def test_a_checkpoint_saved_a_few_gb_at_a_time_restores_as_any_other(tmp_path, pinned_host):
    """Checkpoints(host_gb=..., pinned_host=...) (the Hugging Face import's save: the
    device-to-host copy bounded, through pinned memory or not) writes what the trainer's own
    Checkpoints restore, value for value; the trainer then keeps saving into the same
    directory."""
    state = _state()
    bounded = _checkpoints(tmp_path)
    bounded.host_gb, bounded.pinned_host = 1, pinned_host
    want = {"save_device_host_concurrent_gb": 1}
    if pinned_host is not None:
        want["enable_pinned_host_transfer"] = pinned_host
    assert bounded.handler_options() == want
    assert _checkpoints(tmp_path).handler_options() == {}
    mngr = bounded.manager()
    bounded.save(mngr, state, 0)
    mngr.wait_until_finished()
    mngr.close()
    ckpts = _checkpoints(tmp_path)
    mngr = ckpts.manager(create=False)
    got, step, notes = ckpts.restore_newest(mngr, set_aside=False)
    ckpts.save(mngr, _state(), 1)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 1]
    mngr.close()
    assert (step, notes) == (0, [])
    for want, have in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
