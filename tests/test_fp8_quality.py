"""benchmarks/fp8_quality.py without training: its options, the runs it plans, the gaps and
the check it computes from eval curves, and the command it gives experiments.main (a fake
main writes the job directory a real one would). The benchmark's own end-to-end run trains
for minutes, so the suite does not run it."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import corpus
from benchmarks import fp8_quality as fq
from benchmarks import fp8_quality_report as fq_report
from benchmarks import fp8_quality_runs as fq_runs

VARIANT = "model.stacked_transformer_tpl.moe_layer_tpl.fp8_gemms='fwd+dgrad'"


class FakeData:
    batch_size, seq_len = 4, 64


def fake_main(monkeypatch, run):
    """A fake experiments.main in the real one's place: run(job_dir, cmd) -> (exit status,
    stdout, stderr), job_dir the one the command names; the config the benchmark reads back
    from a job directory has FakeData's batch shape."""

    def run_child(cmd):
        job = Path(next(c.split("=", 1)[1] for c in cmd if c.startswith("--job_log_dir=")))
        return subprocess.CompletedProcess(cmd, *run(job, cmd))

    monkeypatch.setattr(fq_runs, "run_child", run_child)
    monkeypatch.setattr(fq_runs.jobdir, "load_recorded",
                        lambda d: type("C", (), {"data": FakeData}))


def write_metrics(job: Path, recs: list[dict]):
    job.mkdir(parents=True, exist_ok=True)
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_options_and_the_runs_planned(tmp_path, capsys):
    args = fq.parse_args([
        "--steps", "500", "--eval_every", "100", "--data",
        str(tmp_path), "--fdl_set", "data.batch_size=8", "--variant", "wgrad_bf16", VARIANT
    ])
    runs = fq.plan_runs(args)
    assert [r["name"] for r in runs] == ["base", "fp8", "wgrad_bf16"]
    assert [r["exp"] for r in runs] == [args.base, args.fp8, args.fp8]
    common = [
        "data.batch_size=8", f"data.path={str(tmp_path.resolve())!r}", "train.num_steps=500",
        "train.eval_every=100"
    ]
    assert runs[0]["changes"] == runs[1]["changes"] == common
    assert runs[2]["changes"] == common + [VARIANT]
    for bad, said in ((["--variant", "a=b"],
                       "the first value is the run's name"), (["--variant",
                                                               "x"], "give one or more PATH=VALUE"),
                      (["--variant", "x",
                        "nochange"], "give one or more PATH=VALUE"), (["--variant", "fp8",
                                                                       "a=1"], "must differ"),
                      (["--variant", "x", "a=1", "--variant", "x",
                        "b=2"], "must differ"), (["--fdl_set", "nope"], "give PATH=VALUE"),
                      (["--data", str(tmp_path / "missing")], "no such file or folder")):
        with pytest.raises(SystemExit):
            fq.parse_args(bad)
        assert said in capsys.readouterr().err, bad


def test_stdlib_corpus_is_made_once_and_used_as_the_data(tmp_path, capsys):
    path = tmp_path / "c" / "stdlib.txt"
    args = fq.parse_args(["--stdlib_corpus", str(path)])
    assert args.data == str(path) and path.stat().st_size > 10_000_000  # the 10 MB
    text = path.read_text()
    assert "def " in text and "import " in text and not path.with_name("stdlib.txt.tmp").exists()
    assert f"wrote {path}" in capsys.readouterr().out
    path.write_text("kept")
    fq.parse_args(["--stdlib_corpus", str(path)])
    assert path.read_text() == "kept" and "wrote" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fq.parse_args(["--stdlib_corpus", str(path), "--data", str(tmp_path)])
    assert "not both" in capsys.readouterr().err


def test_a_small_stdlib_is_topped_up_from_site_packages(tmp_path, monkeypatch, capsys):
    """A standard library under min_bytes (the GPU machine's 3.12 holds 9.6 MB) is followed by
    the installed packages' sources, sorted, until the corpus reaches it; files over
    max_file_bytes are left out of both."""
    std, pure = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    (pure / "pkg").mkdir(parents=True)
    (std / "a.py").write_text("s" * 400)
    (std / "big.py").write_text("x" * 2000)
    (pure / "pkg" / "b.py").write_text("b" * 300)
    (pure / "pkg" / "c.py").write_text("c" * 300)
    (pure / "pkg" / "d.py").write_text("d" * 300)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {
        "stdlib": str(std),
        "purelib": str(pure)
    })
    out = corpus.stdlib_corpus(tmp_path / "c.txt", max_file_bytes=1000, min_bytes=900)
    assert out.read_text() == "s" * 400 + "\n" + "b" * 300 + "\n" + "c" * 300 + "\n"
    assert f"1 files of {std} and 2 of {pure}" in capsys.readouterr().out
    whole = corpus.stdlib_corpus(tmp_path / "w.txt", max_file_bytes=1000, min_bytes=100)
    assert whole.read_text() == "s" * 400 + "\n"  # enough already: no site-packages


def test_a_record_of_another_corpus_or_gpu_is_trained_again(tmp_path, capsys):
    """A finished run is read back only where its corpus's size and its GPU match this run's
    (the same data.path can hold a topped-up corpus; another GPU rounds otherwise); a record
    made before they were recorded matches on the experiment and changes alone; the XLA flags
    (absent: none) must match."""
    run = dict(name="base", exp="e", changes=["a=1"], data_bytes=10, accelerator="H100")
    rec = dict(run, heldout_loss={"0": 5.0}, train_xent={"1": 5.5})
    (tmp_path / fq_runs.RECORD).write_text(json.dumps(rec))
    got = fq_runs.finished(run, tmp_path)
    assert got["heldout_loss"] == {0: 5.0} and got["train_xent"] == {1: 5.5}
    assert fq_runs.finished(dict(run, data_bytes=12), tmp_path) is None
    assert "had data_bytes=10, this one 12: training it again" in capsys.readouterr().out
    assert fq_runs.finished(dict(run, accelerator="H200"), tmp_path) is None
    old = {k: v for k, v in rec.items() if k not in fq_runs.MUST_MATCH}
    (tmp_path / fq_runs.RECORD).write_text(json.dumps(old))
    assert fq_runs.finished(run, tmp_path)["heldout_loss"] == {0: 5.0}
    # XLA flags must match, a record without them having run with none
    flags = "--xla_gpu_deterministic_ops=true"
    assert fq_runs.finished(dict(run, xla_flags=flags), tmp_path) is None
    assert f"had xla_flags=None, this one {flags!r}: training it again" in capsys.readouterr().out
    (tmp_path / fq_runs.RECORD).write_text(json.dumps(dict(rec, xla_flags=flags)))
    assert fq_runs.finished(run, tmp_path) is None
    assert fq_runs.finished(dict(run, xla_flags=flags), tmp_path)["heldout_loss"] == {0: 5.0}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("abc")
    (tmp_path / "d" / "y.txt").write_text("de")
    assert corpus.data_bytes(tmp_path / "d") == 5 and corpus.data_bytes(None) is None


def test_a_stopped_benchmark_stops_its_main_first(tmp_path):
    """SIGTERM to the benchmark (timeout(1)) reaches the main it runs before it exits: a child
    that records the signal and exits writes its file, and the benchmark ends with the signal."""
    flag, ready = tmp_path / "stopped", tmp_path / "ready"
    child = ("import signal, sys, time, pathlib\n"
             "def stop(*a):\n"
             f"    pathlib.Path({str(flag)!r}).write_text('saved'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             f"pathlib.Path({str(ready)!r}).write_text('ready')\n"
             "time.sleep(60)\n")
    parent = ("import signal, sys\n"
              "from benchmarks import fp8_quality as fq, fp8_quality_runs as fq_runs\n"
              "signal.signal(signal.SIGTERM, fq._interrupt)\n"
              f"fq_runs.run_child([sys.executable, '-c', {child!r}])\n")
    p = subprocess.Popen([sys.executable, "-c", parent],
                         cwd=fq.ROOT,
                         stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 180  # the parent imports jax and starts the child
    while not ready.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert ready.exists(), "the child did not start"
    p.terminate()
    err = p.communicate(timeout=60)[1]
    assert flag.read_text() == "saved" and "KeyboardInterrupt: signal 15" in err, err[-2000:]


def _run(name, losses, **kw):
    return dict(name=name, heldout_loss=dict(losses), **kw)


def test_gaps_and_the_check_at_every_eval():
    """The check is the fp8 run at every eval after step 0 (not only the last); variants are
    reported, not checked; only the steps every run has are compared."""
    base = _run("base", {0: 5.0, 100: 2.0, 200: 1.5})
    late = _run("fp8", {0: 5.0, 100: 2.06, 200: 1.5})  # 3% at step 100, level at the end
    var = _run("wgrad_bf16", {0: 5.0, 100: 2.5, 200: 1.8, 300: 1.0})
    got = fq.compare([base, late, var], 0.01)
    assert got["steps"] == [0, 100, 200]
    assert got["gaps"]["fp8"][100] == pytest.approx(0.03)
    assert got["max_abs_gap_fp8"] == pytest.approx(0.03) and not got["pass"]
    good = _run("fp8", {0: 5.5, 100: 2.01, 200: 1.49})  # step 0 is not checked
    assert fq.compare([base, good, var], 0.01)["pass"]
    text = fq.table([base, good, var], fq.compare([base, good, var], 0.01))
    assert "| 100 | 2.0000 | 2.0100 | 2.5000 | +0.50% | +25.00% |" in text
    seen = dict(corpus_tokens=1000, final_step=4, tokens_per_step=500)
    assert fq_report.read_share(seen) == 2.0 and fq_report.read_share(dict(
        seen, corpus_tokens=None)) is None


def test_train_windows_compare_the_runs_between_evals():
    """Beside the held-out gaps: each run's mean train cross-entropy over the steps since the
    previous eval (only the steps every run recorded), its gap to the base and the controls'
    largest; the table prints them under the held-out one."""
    xb = {t: 2.0 for t in range(1, 201)}
    xf = {t: 2.0 if t <= 100 else 2.2 for t in range(1, 201)}
    xc = {t: 2.0 + (0.02 if t % 2 else -0.02) for t in range(1, 201) if t != 150}
    runs = [
        _run("base", {
            0: 5.0,
            100: 2.0,
            200: 1.5
        }, train_xent=xb),
        _run("fp8", {
            0: 5.0,
            100: 2.0,
            200: 1.5
        }, train_xent=xf),
        _run("ctl", {
            0: 5.0,
            100: 2.0,
            200: 1.5
        }, train_xent=xc, control=True)
    ]
    got = fq.compare(runs, 0.01)
    assert list(got["train_windows"]) == [100, 200]
    assert got["train_windows"][200][1] == pytest.approx(2.2)
    assert got["train_window_gaps"]["fp8"] == pytest.approx({100: 0.0, 200: 0.1})
    # step 150 is missing from the control: the window 101-200 averages the 99 common steps
    assert got["train_window_gaps"]["ctl"][200] == pytest.approx(0.02 / 99 / 2.0)
    assert got["noise_floor_train"] == pytest.approx(0.02 / 99 / 2.0)
    assert got["pass"]  # the held-out check alone decides
    text = fq.table(runs, got)
    assert "| 101-200 | 2.0000 | 2.2000 | 2.0002 | +10.00% | +0.01% |" in text
    bare = fq.compare([_run("base", {0: 5.0, 100: 2.0}), _run("fp8", {0: 5.0, 100: 2.0})], 0.01)
    assert bare["train_windows"] == {} and bare["noise_floor_train"] is None
    assert "train cross-entropy" not in fq.table(
        [_run("base", {
            0: 5.0,
            100: 2.0
        }), _run("fp8", {
            0: 5.0,
            100: 2.0
        })], bare)


def test_router_entropy_is_averaged_between_evals_and_read_back_from_older_records(tmp_path):
    """Each run's mean router entropy over the steps since the previous eval is reported (not
    checked) and printed; a record made before the curve was recorded takes it from the run's
    metrics.jsonl, and one without its metrics has none."""
    soft = {t: 1.5 for t in range(1, 201)}
    frozen = {t: 1.5 if t <= 100 else 0.02 for t in range(1, 201)}
    runs = [
        _run("base", {
            0: 5.0,
            100: 2.0,
            200: 1.5
        }, train_xent=soft, router_entropy=soft),
        _run("fp8", {
            0: 5.0,
            100: 2.0,
            200: 1.5
        }, train_xent=soft, router_entropy=frozen)
    ]
    got = fq.compare(runs, 0.01)
    windows = got["router_entropy_windows"]
    assert list(windows) == [100, 200] and windows[100] == pytest.approx([1.5, 1.5])
    assert windows[200] == pytest.approx([1.5, 0.02])
    assert "| 101-200 | 1.500 | 0.020 |" in fq.table(runs, got)
    assert "router entropy" not in fq.table(
        runs[:1] + [_run("fp8", runs[1]["heldout_loss"])],
        fq.compare([runs[0], _run("fp8", runs[1]["heldout_loss"])], 0.01))
    run = dict(name="base", exp="e", changes=[])
    (tmp_path / fq_runs.RECORD).write_text(
        json.dumps(dict(run, heldout_loss={"0": 5.0}, train_xent={"1": 5.5})))
    assert fq_runs.finished(run, tmp_path)["router_entropy"] == {}
    recs = [{
        "kind": "train",
        "step": t,
        "xent": 5.5,
        "router_entropy": 2.0 - t / 10
    } for t in (1, 2)] + [{
        "kind": "eval",
        "step": 2,
        "heldout_loss": 4.0
    }]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = fq_runs.finished(run, tmp_path)
    assert got["router_entropy"] == pytest.approx({1: 1.9, 2: 1.8})
    assert got["train_xent"] == {1: 5.5}  # the record's own curve, not the metrics'
    assert fq_runs.train_curve(recs, "router_entropy") == pytest.approx({1: 1.9, 2: 1.8})


def test_a_run_at_another_seed_is_read_against_that_seeds_bf16_run():
    """fp8.s1 and a variant at train.seed=1 are read against base.s1, base.s1 itself and the
    seed-0 runs against the base; a seed without a base run falls back to the base; the
    table names the reference where it is not the base."""
    s1 = ["train.seed=1"]
    runs = [
        _run("base", {
            0: 5.0,
            100: 2.0
        }, group="base", own=[]),
        _run("fp8", {
            0: 5.0,
            100: 2.02
        }, group="fp8", own=[]),
        _run("base.s1", {
            0: 5.0,
            100: 2.5
        }, group="base", own=s1),
        _run("fp8.s1", {
            0: 5.0,
            100: 2.55
        }, group="fp8", own=s1),
        _run("v", {
            0: 5.0,
            100: 1.9
        }, own=["a.b=1"]),
        _run("v.s1", {
            0: 5.0,
            100: 2.25
        }, own=["a.b=1"] + s1),
        _run("v.s2", {
            0: 5.0,
            100: 2.1
        }, own=["a.b=1", "train.seed=2"]),
    ]
    got = fq.compare(runs, 0.01)
    assert got["gap_references"] == {
        "fp8": "base",
        "base.s1": "base",
        "fp8.s1": "base.s1",
        "v": "base",
        "v.s1": "base.s1",
        "v.s2": "base"
    }
    gaps = {n: g[100] for n, g in got["gaps"].items()}
    assert gaps == pytest.approx({
        "fp8": 0.01,
        "base.s1": 0.25,
        "fp8.s1": 0.02,
        "v": -0.05,
        "v.s1": -0.1,
        "v.s2": 0.05
    })
    assert got["max_abs_gap_fp8"] == pytest.approx(0.01)  # the check: fp8 against base
    text = fq.table(runs, got)
    assert "| gap fp8 | gap base.s1 | gap fp8.s1 (to base.s1) | gap v | gap v.s1 (to base.s1) |" \
        in text
    assert "| 100 | 2.0000 | 2.0200 | 2.5000 | 2.5500 | 1.9000 | 2.2500 | 2.1000 | +1.00% | " \
        "+25.00% | +2.00% | -5.00% | -10.00% | +5.00% |" in text
    assert fq_report.seed_of(runs[5]) == 1 and fq_report.seed_of(runs[4]) is None


def test_the_command_given_to_the_main_and_what_is_read_back(tmp_path, monkeypatch, capsys):
    """A fake experiments.main records its argv and writes metrics, a config and the data
    line; the benchmark passes each run its changes, reads the curves back and writes the
    JSON, exit 1 where the fp8 run is over the gap."""
    seen = []

    def fake_run(job, cmd):
        seen.append(cmd)
        write_metrics(job, [
            dict(kind="eval", step=0, heldout_loss=5.0),
            dict(kind="train", step=8, tokens_per_sec=10.0),
            dict(kind="eval", step=8, heldout_loss={
                "base": 2.0,
                "fp8": 2.1,
                "v": 2.2
            }[job.name])
        ])
        return 0, "data: source text /x, 1 files, 3 documents, 2,048 tokens (2,048 bytes), ...\n", ""

    fake_main(monkeypatch, fake_run)
    out = tmp_path / "r.json"
    rc = fq.main(
        ["--steps", "8", "--keep",
         str(tmp_path), "--out",
         str(out), "--variant", "v", "a.b=1"])
    assert rc == 1
    assert seen[0][:3] == [sys.executable, "-m", "experiments.main"]
    assert "--fdl_set=train.num_steps=8" in seen[1] and "--fdl_set=a.b=1" in seen[2]
    assert "--fdl_set=a.b=1" not in seen[1]
    got = json.loads(out.read_text())
    assert got["relative_gaps"]["fp8"]["8"] == pytest.approx(0.05) and not got["pass"]
    assert got["date"].startswith("20") and "commit" in got and "accelerator" in got
    assert got["corpus_read"] == pytest.approx(8 * 256 / 2048)
    assert "read 1.00 of it" in capsys.readouterr().out


def test_finished_runs_are_recorded_read_back_and_lose_their_checkpoints(tmp_path, monkeypatch):
    """A finished run records its result in its job directory and its checkpoints go
    (--keep_checkpoints keeps them); the same command again reads finished runs without
    starting the main; a run that fails leaves the JSON of the runs before it, marked
    incomplete; a record of other changes is not taken for this run."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # as fq_runs.train is called without them
    seen, fail = [], set()

    def fake_run(job, cmd):
        seen.append(job.name)
        if job.name in fail:
            return 3, "", "disk full"
        (job / "checkpoints" / "8").mkdir(parents=True, exist_ok=True)
        recs = [
            dict(kind="eval", step=0, heldout_loss=5.0),
            dict(kind="train", step=8, tokens_per_sec=10.0),
            dict(kind="eval", step=8, heldout_loss=2.0)
        ]
        write_metrics(job, recs)
        return 0, "", ""

    fake_main(monkeypatch, fake_run)
    out = tmp_path / "r.json"
    argv = [
        "--steps", "8", "--keep",
        str(tmp_path / "k"), "--out",
        str(out), "--variant", "v", "a.b=1"
    ]
    fail.add("v")
    with pytest.raises(SystemExit, match=r"v \(.*\) failed \(exit 3\):\ndisk full"):
        fq.main(argv)
    part = json.loads(out.read_text())
    assert part["complete"] is False and [r["name"] for r in part["runs"]] == ["base", "fp8"]
    for name in ("base", "fp8"):
        assert not (tmp_path / "k" / name / "checkpoints").exists()
        assert (tmp_path / "k" / name / fq_runs.RECORD).exists()
    fail.clear()
    seen.clear()
    assert fq.main(argv) == 0
    assert seen == ["v"]  # base and fp8 were read, not trained again
    got = json.loads(out.read_text())
    assert got["complete"] is True and got["relative_gaps"]["fp8"]["8"] == 0.0
    # a record made before `group` was recorded takes this plan's
    rec = tmp_path / "k" / "fp8" / fq_runs.RECORD
    rec.write_text(
        json.dumps({
            k: v
            for k, v in json.loads(rec.read_text()).items() if k != "group"
        }))
    plan = fq.plan_runs(fq.parse_args(argv))
    assert fq_runs.train(plan[1], tmp_path / "k" / "fp8")["group"] == "fp8"
    # a record made under other changes is not this run's
    other = fq.plan_runs(fq.parse_args(argv + ["--fdl_set", "c.d=2"]))[0]
    assert fq_runs.finished(other, tmp_path / "k" / "base") is None
    seen.clear()
    assert fq.main(argv[:4] + ["--keep_checkpoints", "--out", str(out)]) == 0
    assert seen == []  # same changes as before: all read
    fq_runs.train(dict(name="w", exp="x", changes=["e.f=1"], own=[]), tmp_path / "k" / "w", True)
    assert (tmp_path / "k" / "w" / "checkpoints").exists()


def test_a_control_is_a_run_of_the_base_and_sets_the_noise_floor(tmp_path, capsys):
    """--control NAME PATH=VALUE: one more run of --base (not --fp8) with its changes; its gap
    to base is reported as the noise floor, and the check stays the fp8 run's."""
    ctl = "model.stacked_transformer_tpl.moe_layer_tpl.router_precision='bf16x3'"
    args = fq.parse_args(["--variant", "v", VARIANT, "--control", "bf16_router", ctl])
    runs = fq.plan_runs(args)
    assert [(r["name"], r["exp"], r.get("control", False))
            for r in runs] == [("base", args.base, False), ("fp8", args.fp8, False),
                               ("bf16_router", args.base, True), ("v", args.fp8, False)]
    assert runs[2]["own"] == [ctl] and runs[2]["changes"][-1] == ctl
    base = _run("base", {0: 5.0, 100: 2.0, 200: 1.5})
    fp8 = _run("fp8", {0: 5.0, 100: 2.01, 200: 1.5})
    control = _run("bf16_router", {0: 5.0, 100: 2.04, 200: 1.47}, control=True)
    got = fq.compare([base, fp8, control], 0.01)
    assert got["noise_floor"] == pytest.approx(0.02) and got["pass"]
    assert fq.compare([base, fp8], 0.01)["noise_floor"] is None
    with pytest.raises(SystemExit):
        fq.parse_args(["--control", "base", ctl])
    assert "must differ" in capsys.readouterr().err


def test_seeds_plan_both_formats_at_each_seed(tmp_path, capsys):
    args = fq.parse_args(
        ["--steps", "300", "--seeds", "3", "--control", "ctl", "a=1", "--variant", "v", "b=2"])
    runs = fq.plan_runs(args)
    assert [r["name"]
            for r in runs] == ["base", "fp8", "base.s1", "fp8.s1", "base.s2", "fp8.s2", "ctl", "v"]
    assert [r.get("group") for r in runs] == ["base", "fp8"] * 3 + [None, None]
    assert runs[4]["exp"] == args.base and runs[5]["exp"] == args.fp8
    assert runs[4]["changes"] == runs[0]["changes"] + ["train.seed=2"]
    assert runs[5]["own"] == ["train.seed=2"] and runs[1]["own"] == []
    for bad, said in ((["--seeds", "0"], "--seeds 0: give 1 or more"),
                      (["--seeds", "2", "--variant", "fp8.s1", "a=1"], "must differ")):
        with pytest.raises(SystemExit):
            fq.parse_args(bad)
        assert said in capsys.readouterr().err, bad


def test_with_seeds_the_check_is_the_gap_of_the_means():
    """Two seeds a format: the seed-0 pair is 4% apart, but the other pair is 3.5% apart the
    other way, so the means are 0.24% apart and the check passes on them; the per-seed gaps
    and each format's spread are reported beside them, train windows too."""
    roles = (("base", 2.0, 2.0, dict(group="base")), ("fp8", 2.08, 2.1, dict(group="fp8")),
             ("base.s1", 2.2, 2.2, dict(group="base")), ("fp8.s1", 2.13, 2.1, dict(group="fp8")),
             ("ctl", 2.01, 2.0, dict(control=True)))
    runs = [
        _run(name, {
            0: 5.0,
            100: at_100
        }, train_xent={t: xent
                       for t in range(1, 101)}, **role) for name, at_100, xent, role in roles
    ]
    got = fq.compare(runs, 0.01)
    st = got["seeds"]["steps"][100]
    assert got["seeds"]["seeds"] == 2
    assert st["base_mean"] == pytest.approx(2.1) and st["fp8_mean"] == pytest.approx(2.105)
    assert st["gap_of_means"] == pytest.approx(0.005 / 2.1)
    assert st["paired_gaps"] == pytest.approx([0.04, -0.07 / 2.2])
    assert st["base_spread"] == pytest.approx(0.1 / 2.1)
    assert st["fp8_spread"] == pytest.approx(0.025 / 2.105)
    assert got["max_abs_gap_fp8"] == pytest.approx(0.04)  # the seed-0 pair, reported
    assert got["max_abs_gap_checked"] == pytest.approx(0.005 / 2.1) and got["pass"]
    assert got["seeds"]["train_windows"][100]["gap_of_means"] == pytest.approx(0.0)
    text = fq.table(runs, got)
    assert "over 2 seeds each, held-out loss:" in text
    # standard errors: from the two formats' sample variances (0.02 and 0.00125), and from
    # the per-seed gaps' (two gaps: |difference| / sqrt(2), over sqrt(2) seeds)
    assert st["gap_se"] == pytest.approx((0.02 / 2 + 0.00125 / 2)**0.5 / 2.1)
    assert st["paired_gap_se"] == pytest.approx((0.04 + 0.07 / 2.2) / 2)
    assert "| 100 | 2.1000 | 2.1050 | +0.24% | +4.00%, -3.18% | 4.76% | 1.19% | 4.91% / " \
        "3.59% |" in text
    # one run a format: no seed statistics, the seed-0 pair is the check
    single = fq.compare([runs[0], runs[1], runs[4]], 0.01)
    assert single["seeds"] is None and not single["pass"]
    assert single["max_abs_gap_checked"] == pytest.approx(0.04)


def test_branch_at_plans_each_run_from_its_seeds_trunk(tmp_path, capsys):
    """--branch_at STEP: every run, the base runs too, gets its seed's bf16 trunk (the base's
    config to STEP), a seed's runs planned together, its base first; bad steps are one-line
    errors."""
    argv = ["--steps", "500", "--eval_every", "100", "--seeds", "2", "--variant", "v", "a.b=1"]
    runs = fq.plan_runs(
        fq.parse_args(argv + ["--variant", "v.s1", "a.b=1", "train.seed=1"] +
                      ["--control", "c", "x.y=2", "--branch_at", "100"]))
    assert [r["name"] for r in runs] == ["base", "fp8", "c", "v", "base.s1", "fp8.s1", "v.s1"]
    for r in runs[:4]:
        assert r["trunk"] == dict(
            name="trunk", exp=runs[0]["exp"], changes=runs[0]["changes"],
            step=100) and r["branch_at"] == 100
    for r in runs[4:]:
        assert r["trunk"]["name"] == "trunk.s1" and r["trunk"]["changes"] == runs[4]["changes"]
        assert "train.seed=1" in r["trunk"]["changes"]
    assert [r["name"] for r in fq.plan_runs(fq.parse_args(argv))
            ] == ["base", "fp8", "base.s1", "fp8.s1", "v"]  # no branch: the order as before
    zero = fq.plan_runs(
        fq.parse_args(argv + ["--variant", "z", "train.seed=0", "--branch_at", "100"]))
    assert {r["name"]: r["trunk"]["name"] for r in zero if "trunk" in r}["z"] == "trunk"
    with pytest.raises(SystemExit, match=r"\['v.s3'\] run at a seed with no base run"):
        fq.plan_runs(
            fq.parse_args(argv + ["--variant", "v.s3", "train.seed=3"] + ["--branch_at", "100"]))
    for bad, said in ((["--branch_at", "50"], "a multiple of --eval_every 100 between 0 and"),
                      (["--branch_at", "500"], "between 0 and --steps 500"),
                      (["--branch_at", "-100"], "between 0 and --steps 500")):
        with pytest.raises(SystemExit):
            fq.parse_args(argv + bad)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fq.parse_args(["--branch_at", "100", "--steps", "500"])
    assert "give --steps and --eval_every with it" in capsys.readouterr().err


def test_branches_start_from_a_hard_linked_trunk_trained_once(tmp_path, monkeypatch, capsys):
    """A fake main: the trunk is trained once to its step (stopped there by SIGTERM), each branch
    starts from a copy of its job directory whose checkpoint files are hard links, resumes under
    its own config (--allow_config_change), and the trunk's checkpoint goes after its last
    branch; a branch cut short resumes from its own checkpoint; the same command again reads
    every run; a record made without the branch is not read back as a branched run."""
    seen, cut, resumed = [], {"v"}, set()

    def fake_run(job, cmd):
        seen.append((job.name, cmd))
        if "--fdl_set=train.sigterm_at_step=4" in cmd:  # the trunk: stops at step 4 and saves
            (job / "checkpoints" / "4" / "default").mkdir(parents=True)
            (job / "checkpoints" / "4" / "default" / "data").write_text("state at 4")
            (job / "config.json").write_text("{}")
            (job / "metrics.jsonl").write_text(
                json.dumps(dict(kind="eval", step=0, heldout_loss=5.0)) + "\n" +
                json.dumps(dict(kind="eval", step=4, heldout_loss=3.0)) + "\n")
            return 143, "", ""
        # a branch (the base run too: its trunk continued) holds the trunk's state and curves
        data = job / "checkpoints" / "4" / "default" / "data"
        assert data.read_text() == "state at 4" and data.stat().st_nlink >= 2
        assert "--allow_config_change" in cmd
        recs = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
        # its first start evaluates the trunk's state under its own config first; a resumed
        # start does not
        fresh = "--fdl_set=train.eval_on_restore=True" in cmd
        assert fresh == (job.name not in resumed)
        if fresh:
            own = {"base": 3.0, "fp8": 3.03, "v": 3.3, "w": 3.06}[job.name]
            recs.append(dict(kind="eval", step=4, heldout_loss=own))
            write_metrics(job, recs)
        if job.name in cut:  # stopped at step 6 with its checkpoint
            (job / "checkpoints" / "6").mkdir()
            return 143, "", "stopped at 6"
        if job.name in resumed:  # its own checkpoint is still there
            assert (job / "checkpoints" / "6").is_dir()
        (job / "checkpoints" / "8").mkdir(parents=True, exist_ok=True)
        loss = {"base": 2.0, "fp8": 2.02, "v": 2.1, "w": 2.05}[job.name]
        recs += [
            dict(kind="train", step=8, tokens_per_sec=10.0),
            dict(kind="eval", step=8, heldout_loss=loss)
        ]
        write_metrics(job, recs)
        return 0, "", ""

    fake_main(monkeypatch, fake_run)
    keep, out = tmp_path / "k", tmp_path / "r.json"
    argv = [
        "--steps", "8", "--eval_every", "4", "--branch_at", "4", "--keep",
        str(keep), "--out",
        str(out), "--variant", "v", "a.b=1"
    ]
    with pytest.raises(SystemExit, match=r"v \(.*\) failed \(exit 143\):\nstopped at 6"):
        fq.main(argv)
    assert [name for name, _ in seen] == ["trunk", "base", "fp8", "v"]
    assert not any("--fdl_set=train.sigterm_at_step=4" in cmd for _, cmd in seen[1:])
    assert (keep / "trunk" / "checkpoints" / "4").is_dir()  # v has not finished
    cut.clear()
    seen.clear()
    resumed.add("v")
    assert fq.main(argv) == 1  # fp8 2% above base at step 8
    assert [name for name, _ in seen] == ["v"]
    assert not (keep / "trunk" / "checkpoints").exists()  # gone after its last branch
    assert json.loads((keep / "trunk" / fq_runs.TRUNK_RECORD).read_text())["step"] == 4
    got = json.loads(out.read_text())
    # at the branch step, each run's own config on the trunk's state (the resumed v's from its
    # first start)
    assert got["branch_at"] == 4 and got["relative_gaps"]["fp8"]["4"] == pytest.approx(0.01)
    assert got["relative_gaps"]["v"]["4"] == pytest.approx(0.1)
    assert all(r["evaluated_at_branch"] for r in got["runs"])
    assert got["relative_gaps"]["fp8"]["8"] == pytest.approx(0.01)
    printed = capsys.readouterr().out
    assert "branched at step 4 from its seed's bf16 trunk" in printed
    assert (
        "at step 4 each branch first evaluated its trunk's state under its own config (the "
        "same weights, before any step under it), against base: fp8 +1.000%, v +10.000%") in printed
    seen.clear()
    assert fq.main(argv) == 1 and seen == []  # all read back, no trunk trained
    # the records are branched ones: not taken for an unbranched plan's runs
    plain = fq.plan_runs(fq.parse_args(argv[:4] + argv[6:]))
    assert fq_runs.finished(plain[1], keep / "fp8") is None
    assert fq_runs.finished(plain[0], keep / "base") is None
    # a new variant trains the trunk again (its checkpoint is gone), and since a GPU does not
    # repeat that training bit for bit, the seed's finished runs are moved aside and branch
    # from the new training with it
    seen.clear()
    resumed.clear()
    trained = json.loads((keep / "fp8" / fq_runs.RECORD).read_text())["trunk_trained"]
    assert fq.main(argv + ["--variant", "w", "a.b=2"]) == 1
    assert [name for name, _ in seen] == ["trunk", "base", "fp8", "v", "w"]
    assert ("base, fp8, v: finished from another training of trunk than the one the other runs "
            "of its seed start from") in capsys.readouterr().out
    assert json.loads((keep / "fp8.stale" / fq_runs.RECORD).read_text())["trunk_trained"] == trained
    again = {
        json.loads((keep / n / fq_runs.RECORD).read_text())["trunk_trained"]
        for n in ("base", "fp8", "v", "w")
    }
    assert len(again) == 1 and trained not in again
    seen.clear()
    assert fq.main(argv + ["--variant", "w", "a.b=2"]) == 1 and seen == []  # one training: read
    # a job directory holding another run's branch (other changes) starts anew from the trunk
    fq_runs.make_trunk(plain[0] | {"name": "trunk", "step": 4}, keep / "trunk", plain[0])
    (keep / "x" / "checkpoints" / "6").mkdir(parents=True)
    (keep / "x" / fq_runs.BRANCH_RECORD).write_text(json.dumps({"exp": "y"}))
    fq_runs.start_branch(dict(exp="z", changes=["a.b=4"]), keep / "x", keep / "trunk")
    assert fq_runs._checkpoint_steps(keep / "x") == [4]
    assert json.loads((keep / "x" / fq_runs.BRANCH_RECORD).read_text())["changes"] == ["a.b=4"]


@pytest.mark.slow
def test_a_real_fp8_branch_takes_up_the_bf16_trunks_state(tmp_path):
    """The real main on the CPU (Tiny): the FP8 run branched at step 4 restores the bf16
    trunk's checkpoint under its own config, so up to step 4 its train curves are the base
    run's bit for bit (the CPU is deterministic), and after it they are its own; at step 4 each
    run evaluates the trunk's state under its own config: the base's is the trunk's own eval,
    the FP8 run's the same weights through the FP8 forward."""
    keep = tmp_path / "k"
    rc = fq.main([
        "--steps", "8", "--eval_every", "4", "--branch_at", "4", "--keep",
        str(keep), "--out",
        str(tmp_path / "r.json")
    ])
    got = json.loads((tmp_path / "r.json").read_text())
    assert rc in (0, 1) and got["complete"] and got["branch_at"] == 4
    base, fp8 = got["runs"]
    trunk = [json.loads(x) for x in (keep / "trunk" / "metrics.jsonl").read_text().splitlines()]
    at4 = [r["heldout_loss"] for r in trunk if r["kind"] == "eval" and r["step"] == 4]
    assert base["heldout_loss"]["4"] == at4[0] and base["evaluated_at_branch"]
    assert fp8["evaluated_at_branch"] and fp8["heldout_loss"]["4"] != at4[0]
    assert abs(fp8["heldout_loss"]["4"] / at4[0] - 1) < 0.01  # FP8's rounding, not another state
    assert [fp8["train_xent"][str(t)] for t in range(1, 5)] == \
        [base["train_xent"][str(t)] for t in range(1, 5)]
    assert fp8["heldout_loss"]["8"] != base["heldout_loss"]["8"]
    # the trunk's config, recorded as replaced by the FP8 run's own
    trunk_config = (keep / "trunk" / "config.json").read_text()
    assert (keep / "fp8" / "config.replaced.1.json").read_text() == trunk_config
    assert (keep / "fp8" / "config.json").read_text() != trunk_config
    assert not (keep / "trunk" / "checkpoints").exists()


def test_branched_seeds_report_the_gaps_standard_errors(tmp_path, monkeypatch, capsys):
    """--seeds 2 --branch_at 4 with a fake main: a trunk per seed (trunk, trunk.s1), each FP8
    run branched from its own seed's, and the check's line gives the gap of the means with its
    standard errors at the step where it is largest."""
    seen = []
    loss = {"base": 2.0, "fp8": 2.06, "base.s1": 2.2, "fp8.s1": 2.2}

    def fake_run(job, cmd):
        seen.append(job.name)
        (job / "checkpoints" / "4").mkdir(parents=True, exist_ok=True)
        if job.name.startswith("trunk"):
            assert ("--fdl_set=train.seed=1" in cmd) == (job.name == "trunk.s1")
            (job / "metrics.jsonl"
             ).write_text(json.dumps(dict(kind="eval", step=4, heldout_loss=3.0)) + "\n")
            return 143, "", ""
        recs = [
            dict(kind="eval", step=4, heldout_loss=3.0),
            dict(kind="train", step=8),
            dict(kind="eval", step=8, heldout_loss=loss[job.name])
        ]
        write_metrics(job, recs)
        return 0, "", ""

    fake_main(monkeypatch, fake_run)
    flags = "--xla_gpu_deterministic_ops=true"
    monkeypatch.setenv("XLA_FLAGS", flags)  # recorded with every run and trunk
    out = tmp_path / "r.json"
    assert fq.main([
        "--steps", "8", "--eval_every", "4", "--branch_at", "4", "--seeds", "2", "--keep",
        str(tmp_path / "k"), "--out",
        str(out)
    ]) == 1
    assert seen == ["trunk", "base", "fp8", "trunk.s1", "base.s1", "fp8.s1"]
    got = json.loads(out.read_text())
    assert got["xla_flags"] == flags and {r["xla_flags"] for r in got["runs"]} == {flags}
    assert json.loads(
        (tmp_path / "k" / "trunk.s1" / fq_runs.TRUNK_RECORD).read_text())["xla_flags"] == flags
    st = json.loads(out.read_text())["seeds"]["steps"]["8"]
    assert st["gap_of_means"] == pytest.approx(0.06 / 4.2)
    assert st["paired_gap_se"] == pytest.approx(0.03 / 2)  # gaps 3% and 0%
    text = capsys.readouterr().out
    assert ("largest |gap of the mean held-out losses| after step 4 1.429% (<= 1.00% at every "
            "eval: FAIL); at step 8 its standard error is "
            f"{st['gap_se']:.2%} unpaired, 1.50% paired; the seed-0 pair alone 3.000%") in text


def test_a_trunk_that_cannot_be_linked_is_copied_and_said(tmp_path, monkeypatch, capsys):
    """Where the file system refuses hard links, the branch gets a full copy of the trunk's
    checkpoint (the same bytes) and one line says so; its other files are always copies."""
    trunk = tmp_path / "trunk"
    (trunk / "checkpoints" / "4" / "default").mkdir(parents=True)
    for name in ("a", "b"):
        (trunk / "checkpoints" / "4" / "default" / name).write_text(f"state {name}")
    (trunk / "metrics.jsonl").write_text("{}\n")
    (trunk / fq_runs.TRUNK_RECORD).write_text(json.dumps({"step": 4}))

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(fq_runs.os, "link", no_links)
    fq_runs.start_branch(dict(exp="e", changes=[]), tmp_path / "fp8", trunk)
    got = tmp_path / "fp8" / "checkpoints" / "4" / "default"
    assert [(got / n).read_text() for n in ("a", "b")] == ["state a", "state b"]
    assert (got / "a").stat().st_nlink == 1
    said = capsys.readouterr().out
    assert said.count("the trunk's checkpoint is copied, not linked") == 1
    assert not (tmp_path / "fp8" / fq_runs.TRUNK_RECORD).exists()


def test_report_compares_the_runs_a_set_cut_short_recorded(tmp_path, monkeypatch, capsys):
    """--report FILE: the runs a results JSON recorded before its set was cut short (fp8.s1
    never finished) compared without training: base.s1 is left out and named, the rest are
    compared as the full set would compare them, to --out; --report plans nothing, so a run
    option beside it is an error."""
    loss = {"base": 2.0, "fp8": 2.03, "ctl": 2.01, "base.s1": 2.2}
    seen = []

    def fake_run(job, cmd):
        seen.append(job.name)
        if job.name == "fp8.s1":
            return 1, "", "cut short"
        write_metrics(job, [
            dict(kind="eval", step=0, heldout_loss=5.0),
            dict(kind="train", step=1, xent=3.0 + loss[job.name]),
            dict(kind="eval", step=4, heldout_loss=loss[job.name])
        ])
        return 0, "", ""

    fake_main(monkeypatch, fake_run)
    cut, out = tmp_path / "cut.json", tmp_path / "r.json"
    with pytest.raises(SystemExit, match="fp8.s1"):
        fq.main([
            "--steps", "4", "--eval_every", "4", "--seeds", "2", "--control", "ctl", "a.b=1",
            "--out",
            str(cut)
        ])
    assert seen == ["base", "fp8", "base.s1", "fp8.s1"]  # the plan's order; ctl after the seeds
    assert not json.loads(cut.read_text())["complete"]
    capsys.readouterr()
    assert fq.main(["--report", str(cut), "--out", str(out), "--max_gap", "0.02"]) == 0
    text = capsys.readouterr().out
    assert f"{cut}: left out base.s1 (no finished run of the other format at its seed)" in text
    got = json.loads(out.read_text())
    assert [r["name"] for r in got["runs"]] == ["base", "fp8"]
    assert got["relative_gaps"]["fp8"]["4"] == pytest.approx(0.015)
    assert got["seeds"] is None and got["complete"] is False and got["pass"] is True
    assert got["reported"]["from"] == str(cut) and got["reported"]["left_out"] == ["base.s1"]
    assert got["command"].startswith("python -m benchmarks.fp8_quality --steps 4")
    for bad, said in ((["--seeds",
                        "2"], "--seeds would plan runs"), (["--steps",
                                                            "4"], "--steps would plan runs")):
        with pytest.raises(SystemExit):
            fq.parse_args(["--report", str(cut)] + bad)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fq.parse_args(["--report", str(tmp_path / "none.json")])
    assert "no such file" in capsys.readouterr().err


def test_branched_runs_are_checked_after_the_branch_step():
    """With --branch_at the check reads the evaluations after the branch step: up to it a
    seed's runs share their trunk's curves. A set planned before the base runs branched too
    (its base trained from step 0) is read the same way, and the summary says which it is."""
    extra = dict(corpus_tokens=None)
    base = _run("base", {0: 5.0, 100: 2.0, 200: 1.5}, branch_at=100, **extra)
    fp8 = _run("fp8", {0: 5.0, 100: 2.0, 200: 1.509}, branch_at=100, **extra)
    got = fq.compare([base, fp8], 0.01)
    assert got["checked_steps"] == [200] and got["max_abs_gap_checked"] == pytest.approx(0.006)
    text = "\n".join(fq_report.summary([base, fp8], got, 0.01))
    assert "every run branched at step 100" in text and "after step 100 0.600%" in text
    old_base = _run("base", {0: 5.0, 100: 1.9, 200: 1.5}, **extra)  # 5% below the trunk at 100
    got = fq.compare([old_base, fp8], 0.01)
    assert got["gaps"]["fp8"][100] == pytest.approx(0.1 / 1.9)
    assert got["pass"] and got["max_abs_gap_checked"] == pytest.approx(0.006)
    text = "\n".join(fq_report.summary([old_base, fp8], got, 0.01))
    assert "every run but the base runs branched at step 100" in text and "PASS" in text
    assert fq.compare([_run("base", {
        0: 5.0,
        100: 1.9
    }), _run("fp8", {
        0: 5.0,
        100: 2.0
    })], 0.01)["checked_steps"] == [100]  # no branch: every eval after step 0


def test_a_seeds_runs_read_back_only_from_one_training_of_its_trunk(tmp_path, capsys):
    """set_aside_stale_branches: runs recorded finished from another training of the trunk
    than the live one (its checkpoint still there) are moved aside with their records and named;
    runs from the live one are kept; all finished from one training are all read; records from
    before trainings had ids count as another training."""
    plan = fq.plan_runs(
        fq.parse_args(["--steps", "8", "--eval_every", "4", "--branch_at", "4"] +
                      ["--control", "c", "a.b=1", "--variant", "v", "a.b=2"]))
    trunk = plan[0]["trunk"]

    def record(run, trained):
        (tmp_path / run["name"]).mkdir(exist_ok=True)
        rec = dict(run, heldout_loss={0: 5.0, 8: 2.0})
        if trained is not None:
            rec["trunk_trained"] = trained
        (tmp_path / run["name"] / fq_runs.RECORD).write_text(json.dumps(rec))

    (tmp_path / "trunk" / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "trunk" / fq_runs.TRUNK_RECORD).write_text(
        json.dumps({
            **fq_runs._trunk_want(trunk, plan[0]), "trained": "B"
        }))
    assert fq_runs.ready_trunk(trunk, tmp_path / "trunk", plan[0]) == "B"
    record(plan[0], "A")  # base, from an earlier training
    record(plan[1], "B")  # fp8, from the live one
    record(plan[2], None)  # c, from before trainings had ids; v has not finished
    assert fq_runs.set_aside_stale_branches(plan, tmp_path) == ["base", "c"]
    assert "base, c: finished from another training of trunk" in capsys.readouterr().out
    assert (tmp_path / "base.stale" / fq_runs.RECORD).exists() and not (tmp_path / "base").exists()
    assert fq_runs.finished(plan[1], tmp_path / "fp8")["trunk_trained"] == "B"
    for run in plan:  # all four from the live training: nothing moved
        record(run, "B")
    assert fq_runs.set_aside_stale_branches(plan, tmp_path) == []
    record(plan[0], "A")  # a second stale base goes beside the first
    assert fq_runs.set_aside_stale_branches(plan, tmp_path) == ["base"]
    assert (tmp_path / "base.stale.1").is_dir()
    for run in plan:  # all finished from one training (not the live checkpoint's): read them all
        record(run, "C")
    assert fq_runs.set_aside_stale_branches(plan, tmp_path) == []
