"""What a job directory holds: the resolved experiment config, recorded at the
first start as Fiddle's JSON; resume and eval load and compare it. In-process: main's functions
with parsed flags, and the trainer replaced by a stand-in (nothing is traced or trained)."""

import json

import pytest

from fiddle.experimental import serialization

from configs import experiments
from experiments.job import jobdir
from experiments.train import loop, setup, steps
from experiments import main as main_lib
from tests.flagutil import parse, reset_flags  # noqa: F401  (reset_flags: autouse)


class _Started(Exception):
    """Raised by the stand-in trainer: main got past every check of the start."""


@pytest.fixture
def no_trainer(monkeypatch):
    """Replaces the trainer: main stops where it would trace, holding what it was given."""
    seen = {}

    def trainer(prep, job_log_dir, **kw):
        seen.update(prep=prep, job_log_dir=job_log_dir)
        raise _Started

    monkeypatch.setattr(loop, "Trainer", trainer)
    return seen


def _start(*args):
    """main(argv) with these flags: 'started' when it reached the trainer, else its exit
    status."""
    parse(*args)
    try:
        return main_lib._main(["main"])
    except _Started:
        return "started"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("experiments.main: error: ")
    return err[0]


def test_first_start_records_the_resolved_config(tmp_path, capsys, no_trainer):
    job = tmp_path / "job"
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fiddler=use_synthetic_data",
                  "--fdl.data.seq_len=32") == "started"
    recorded = serialization.load_json((job / jobdir.CONFIG_FILE).read_text())
    want = experiments.tiny()
    experiments.use_synthetic_data(want)
    want.data.seq_len = 32
    want.optimizer.decay_steps = want.train.num_steps  # 0 = num_steps, resolved at the first start
    assert recorded == want
    first = (job / jobdir.CONFIG_FILE).read_text()
    json.loads(first)  # plain JSON, readable by anyone
    # The same flags with more steps and other eval / checkpoint cadences: the same run, which
    # resumes; the record stays the first start's.
    capsys.readouterr()
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fiddler=use_synthetic_data",
                  "--fdl.data.seq_len=32", "--fdl.train.num_steps=400", "--fdl.train.eval_every=7",
                  "--fdl.train.checkpoint_every=3") == "started"
    assert no_trainer["prep"].config.train.num_steps == 400
    assert capsys.readouterr().err == ""
    assert (job / jobdir.CONFIG_FILE).read_text() == first


def test_a_different_exp_or_override_is_refused_naming_dir_and_paths(tmp_path, capsys, no_trainer):
    job = tmp_path / "job"
    assert _start("--exp=tiny", f"--job_log_dir={job}") == "started"
    before = (job / jobdir.CONFIG_FILE).read_text()
    capsys.readouterr()
    no_trainer.clear()
    assert _start("--exp=tiny_synthetic", f"--job_log_dir={job}") == 2
    line = _error_line(capsys)
    assert str(job) in line and "experiment 'tiny'" in line
    assert "name: 'tiny' -> 'tiny_synthetic'" in line and "data.source: None -> 'synthetic'" \
        in line and "--allow_config_change" in line
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fdl.optimizer.b2=0.99") == 2
    assert "optimizer.b2: 0.95 -> 0.99" in _error_line(capsys)
    assert _start("--mode=eval", "--exp=tiny", f"--job_log_dir={job}",
                  "--fdl.model.stacked_transformer_tpl.num_heads=8") == 2
    assert "model.stacked_transformer_tpl.num_heads: 4 -> 8" in _error_line(capsys)
    assert (job / jobdir.CONFIG_FILE).read_text() == before
    assert "prep" not in no_trainer


def test_eval_and_resume_without_exp_use_the_recorded_config(tmp_path, capsys, no_trainer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 200)
    job = tmp_path / "job"
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fdl.data.source='text'",
                  f"--fdl.data.path='{corpus}'",
                  f"--fdl.data.cache_dir='{tmp_path / 'cache'}'") == "started"
    for mode in ("eval", "train"):
        assert _start(f"--mode={mode}", f"--job_log_dir={job}") == "started"
        data = no_trainer["prep"].config.data
        assert data.source == "text" and data.path == str(corpus)
        assert len(no_trainer["prep"].dataset.corpus.tokens) == 95 * 200
    # An override on top of the recorded config is compared with the record as well.
    assert _start(f"--job_log_dir={job}", "--fdl.data.seq_len=16") == 2
    assert "data.seq_len: 64 -> 16" in _error_line(capsys)


def test_allow_config_change_records_the_new_config_and_keeps_the_old(tmp_path, capsys, no_trainer):
    job = tmp_path / "job"
    assert _start("--exp=tiny", f"--job_log_dir={job}") == "started"
    old = (job / jobdir.CONFIG_FILE).read_text()
    capsys.readouterr()
    assert _start("--mode=eval", "--exp=tiny_synthetic", f"--job_log_dir={job}",
                  "--allow_config_change") == "started"
    assert "data.source: None -> 'synthetic'" in capsys.readouterr().err
    assert (job / jobdir.CONFIG_FILE).read_text() == old  # eval writes nothing
    assert _start("--exp=tiny_synthetic", f"--job_log_dir={job}",
                  "--allow_config_change") == "started"
    assert (job / "config.replaced.1.json").read_text() == old
    assert serialization.load_json((job / jobdir.CONFIG_FILE).read_text()).name == \
        "tiny_synthetic"
    assert _start("--exp=tiny_synthetic", f"--job_log_dir={job}") == "started"


def test_an_unreadable_record_is_one_line(tmp_path, capsys, no_trainer):
    job = tmp_path / "job"
    job.mkdir()
    (job / jobdir.CONFIG_FILE).write_text("{not json")
    assert _start("--exp=tiny", f"--job_log_dir={job}") == 2
    line = _error_line(capsys)
    assert str(job / jobdir.CONFIG_FILE) in line and "does not read back" in line
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--allow_config_change") == "started"
    assert (job / "config.replaced.1.json").read_text() == "{not json"


def test_differences_name_every_path_and_skip_the_loop_fields():
    a, b = experiments.tiny(), experiments.tiny()
    b.train.num_steps = 5
    assert jobdir.differences(a, b) == []
    b.model.stacked_transformer_tpl.moe_layers = [1]
    b.mesh.shape = (2, -1)
    assert jobdir.differences(a, b) == [
        "model.stacked_transformer_tpl.moe_layers: [0, 1] -> [1]",
        "mesh.shape: (-1,) -> (2, -1)",
    ]


def test_a_record_holding_what_none_resolves_to_is_the_same_run():
    """A record made before the data pipeline holds data.source='pydoc' and the bytes
    vocabulary 256 where tiny now leaves them None (resolved at the start to the same): no
    change. A record whose value is not what None resolves to still differs."""
    old, now = experiments.tiny(), experiments.tiny()
    assert now.data.source is None and now.model.vocab_size is None
    old.data.source = "pydoc"
    old.model.vocab_size = old.model.softmax_tpl.num_classes = 256
    assert jobdir.differences(old, now) == []
    old.data.source = "synthetic"
    old.model.vocab_size = 512
    assert jobdir.differences(old, now) == [
        "model.vocab_size: 512 -> None",
        "data.source: 'synthetic' -> None",
    ]


def test_a_changed_config_is_recorded_only_once_the_checkpoints_restore(
        tmp_path, capsys, monkeypatch):
    job = tmp_path / "job"
    (job / "checkpoints" / "40").mkdir(parents=True)
    jobdir.record(job, experiments.tiny())
    old = (job / jobdir.CONFIG_FILE).read_text()
    outcome = {}

    class Trainer:

        def __init__(self, prep, job_log_dir, **kw):
            pass

        def run(self):
            if outcome["restores"]:
                return dict(diverged=None,
                            stopped_by=None,
                            start_step=40,
                            final_step=40,
                            first_eval=None,
                            last_eval=None,
                            skipped_steps=0,
                            metrics="m",
                            tensorboard="t",
                            checkpoints="c",
                            plot=str(tmp_path / "none.png"))
            raise setup.ConfigError("no checkpoint in c restores: ...")

    monkeypatch.setattr(loop, "Trainer", Trainer)
    args = ("--exp=tiny", f"--job_log_dir={job}", "--fdl.optimizer.b1=0.8", "--allow_config_change")
    outcome["restores"] = False
    assert _start(*args) == 2
    assert (job / jobdir.CONFIG_FILE).read_text() == old
    assert not (job / "config.replaced.1.json").exists()
    assert "optimizer.b1: 0.9 -> 0.8; recording it once its checkpoints restore" in \
        capsys.readouterr().err
    outcome["restores"] = True
    assert _start(*args) == 0
    assert (job / "config.replaced.1.json").read_text() == old
    assert serialization.load_json((job / jobdir.CONFIG_FILE).read_text()).optimizer.b1 == 0.8


def test_the_schedule_length_is_fixed_at_the_first_start(tmp_path, capsys, no_trainer):
    """decay_steps=0 (= train.num_steps) is resolved once and recorded: a resumed run with more
    steps keeps the first start's schedule (its learning rate stays at the end value past it),
    with or without --exp; a different decay_steps given explicitly is a config change."""
    job = tmp_path / "job"
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fdl.train.num_steps=200") == "started"
    assert serialization.load_json((job / jobdir.CONFIG_FILE).read_text()).optimizer.decay_steps \
        == 200
    for args in (["--exp=tiny"], []):
        assert _start(*args, f"--job_log_dir={job}", "--fdl.train.num_steps=230") == "started"
        exp = no_trainer["prep"].config
        assert exp.train.num_steps == 230 and exp.optimizer.decay_steps == 200
    _, schedule = steps.make_optimizer(exp.optimizer, exp.train.num_steps)
    end = exp.optimizer.learning_rate * exp.optimizer.end_lr_fraction
    assert float(schedule(150)) > end * 1.5
    for step in (200, 201, 229):
        assert float(schedule(step)) == pytest.approx(end, rel=1e-6), step
    capsys.readouterr()
    assert _start("--exp=tiny", f"--job_log_dir={job}", "--fdl.optimizer.decay_steps=230") == 2
    assert "optimizer.decay_steps: 200 -> 230" in _error_line(capsys)
    # A record written before the length was resolved (decay_steps 0) means its own num_steps.
    old = tmp_path / "old"
    old.mkdir()
    jobdir.record(old, experiments.tiny())
    assert _start("--exp=tiny", f"--job_log_dir={old}", "--fdl.train.num_steps=300") == "started"
    assert no_trainer["prep"].config.optimizer.decay_steps == 200


def test_a_mode_that_reads_a_job_creates_nothing(tmp_path, capsys):
    """--mode=eval or --mode=sample of a mistyped directory is one line naming the close run
    and creates nothing; eval of a directory without checkpoints (the real trainer) writes
    nothing there."""
    runs = tmp_path / "runs"
    (runs / "tiny").mkdir(parents=True)
    jobdir.record(runs / "tiny", experiments.tiny())
    for mode in (["--mode=eval"], ["--mode=sample", "--prompt=def main("]):
        assert _start(*mode, f"--job_log_dir={runs / 'tinyy'}") == 2
        line = _error_line(capsys)
        assert f"--job_log_dir='{runs / 'tinyy'}' does not exist" in line, (mode, line)
        assert f"did you mean {runs / 'tiny'}?" in line, (mode, line)
        assert sorted(p.name for p in runs.iterdir()) == ["tiny"]
    before = sorted(p.name for p in (runs / "tiny").iterdir())
    assert _start("--mode=eval", f"--job_log_dir={runs / 'tiny'}") == 2
    assert "needs a checkpoint" in _error_line(capsys)
    assert sorted(p.name for p in (runs / "tiny").iterdir()) == before
