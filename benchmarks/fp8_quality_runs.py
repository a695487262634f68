"""The runs of benchmarks.fp8_quality: each an experiments.main job in its own job directory,
run as a child process (a SIGTERM of the benchmark reaches it first), recorded there when it
finishes and read back instead of trained again; and the bf16 trunks that --branch_at starts
runs from."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from experiments.job import jobdir
from experiments.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
_DATA_LINE = re.compile(r"^data: .*?([\d,]+) tokens \(([\d,]+) bytes\)", re.M)
CHILD_SAVE_S = 300  # how long a stopped main may take to save its step


def main_command(exp: str, job_dir: Path, changes: list[str]) -> list[str]:
    """The experiments.main command of one job: experiment, job directory, config changes."""
    return [
        sys.executable, "-m", "experiments.main", f"--exp={exp}", f"--job_log_dir={job_dir}",
        "--no_progress"
    ] + [f"--fdl_set={c}" for c in changes]


def run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs the main; a SIGTERM or Ctrl-C of this process reaches it first (it stops after its
    step in flight and saves it), so a cut run resumes from there with --keep."""
    proc = subprocess.Popen(cmd,
                            cwd=ROOT,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.terminate()
        proc.communicate(timeout=CHILD_SAVE_S)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


RECORD = "fp8_quality_run.json"  # a finished run's result, in its job directory
# what a recorded run must share with this one beyond its experiment and changes: the corpus
# behind the same data.path (a standard library topped up or not) and the GPU it ran on
MUST_MATCH = ("data_bytes", "accelerator")
# and, absent meaning none, the XLA flags it ran under (--xla_gpu_deterministic_ops=true, say,
# changes the GPU's kernels)
MUST_MATCH_EXACT = ("xla_flags", )


def int_steps(rec: dict) -> dict:
    """A run's record with the step keys of its held-out loss and train curves as ints (JSON
    makes them strings)."""
    return {
        **rec, "heldout_loss": {
            int(k): v
            for k, v in rec["heldout_loss"].items()
        },
        **{
            c: {
                int(k): v
                for k, v in rec[c].items()
            }
            for c in CURVES if c in rec
        }
    }


def finished(run: dict, job_dir: Path, say: bool = True) -> dict | None:
    """The result a finished run recorded in job_dir (RECORD), if it is this run's (the same
    experiment and changes), else None (where it is another corpus's, GPU's or XLA flags',
    a line says so unless not `say`)."""
    try:
        got = json.loads((job_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if (got.get("exp"), got.get("changes"), got.get("branch_at")) != \
            (run["exp"], run["changes"], run.get("branch_at")):
        return None
    for key in MUST_MATCH + MUST_MATCH_EXACT:
        if key in MUST_MATCH and (got.get(key) is None or run.get(key) is None):
            continue  # absent from records made before it was recorded
        if got.get(key) != run.get(key):
            if say:
                print(
                    f"{run['name']}: the run in {job_dir} had {key}={got.get(key)!r}, this one "
                    f"{run.get(key)!r}: training it again",
                    flush=True)
            return None
    got = int_steps(got)
    metrics = job_dir / "metrics.jsonl"
    recs = None
    for key in CURVES:
        if key not in got:  # recorded before this curve was: its metrics hold it, if kept
            if recs is None:
                recs = read_metrics(metrics) if metrics.exists() else []
            got[key] = train_curve(recs, key)
    return got


# the train curves a run records by step: the cross-entropy (the loss less its aux and z terms;
# every run reads the same batches in the same order, so the runs compare step by step) and the
# MoE layers' mean router entropy (how soft the routing still is)
CURVES = {"train_xent": "xent", "router_entropy": "router_entropy"}


def train_curve(recs: list[dict], key: str) -> dict[int, float]:
    """CURVES[key] of the train records by step (none where the runs did not log it)."""
    name = CURVES[key]
    return {r["step"]: r[name] for r in recs if r["kind"] == "train" and name in r}


def train(run: dict, job_dir: Path, keep_checkpoints: bool = False) -> dict:
    """Runs (or resumes, or reads a finished) experiments.main job; its eval curve, recorded
    in job_dir, whose checkpoints go unless keep_checkpoints. A branch (run['trunk']) starts
    from its trunk, trained first where it is not ready (make_trunk, start_branch)."""
    done = finished(run, job_dir)
    if done is not None:
        print(f"{run['name']}: read the finished run in {job_dir}", flush=True)
        # this plan's role for it (a record made before `group` was recorded has none)
        return {**done, **{k: run[k] for k in ("group", "control") if k in run}}
    cmd = main_command(run["exp"], job_dir, run["changes"])
    trained = None
    if "trunk" in run:  # its trunk's state at its step, then this run's own config from there
        trunk_dir = job_dir.parent / run["trunk"]["name"]
        trained = make_trunk(run["trunk"], trunk_dir, run)
        cmd.append("--allow_config_change")
        if start_branch(run, job_dir, trunk_dir):  # its first start: the trunk's state
            cmd.append("--fdl_set=train.eval_on_restore=True")  # evaluated under its config
    t0 = time.time()
    p = run_child(cmd)
    if p.returncode:
        raise SystemExit(f"{run['name']} ({run['exp']}) failed (exit {p.returncode}):\n"
                         f"{p.stderr[-4000:]}")
    recs = read_metrics(job_dir / "metrics.jsonl")
    evals = [r for r in recs if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{run['name']}: no eval records in {job_dir / 'metrics.jsonl'}")
    m = _DATA_LINE.search(p.stdout)
    data = jobdir.load_recorded(job_dir).data
    tps = sorted(r["tokens_per_sec"] for r in recs
                 if r["kind"] == "train" and r["step"] >= 5 and "tokens_per_sec" in r)
    result = {
        **run,
        "seconds": round(time.time() - t0, 1),
        "corpus_tokens": int(m.group(1).replace(",", "")) if m else None,
        "corpus_bytes": int(m.group(2).replace(",", "")) if m else None,
        "tokens_per_step": data.batch_size * data.seq_len,
        "final_step": max((r["step"] for r in recs if r["kind"] == "train"), default=0),
        "tokens_per_sec_median": tps[len(tps) // 2] if tps else None,
        "heldout_loss": {
            r["step"]: r["heldout_loss"]
            for r in evals
        },
        **{
            key: train_curve(recs, key)
            for key in CURVES
        },
    }
    if trained is not None:  # which training of its trunk it started from
        result["trunk_trained"] = trained
        result["evaluated_at_branch"] = evaluated_at_branch(job_dir, run["trunk"]["step"])
    (job_dir / RECORD).write_text(json.dumps(result, indent=1) + "\n")
    if not keep_checkpoints:
        shutil.rmtree(job_dir / "checkpoints", ignore_errors=True)
    return result


TRUNK_RECORD = "fp8_quality_trunk.json"  # a finished trunk's exp, changes and step


def _checkpoint_steps(job_dir: Path) -> list[int]:
    ckpts = job_dir / "checkpoints"
    return sorted(int(d.name) for d in ckpts.iterdir()
                  if d.name.isdigit()) if ckpts.is_dir() else []


def _trunk_want(trunk: dict, run: dict) -> dict:
    """What a trunk's record must hold to serve `run`: experiment, changes, step, and the corpus
    and GPU of the run (MUST_MATCH)."""
    return {
        "exp": trunk["exp"],
        "changes": trunk["changes"],
        "step": trunk["step"],
        **{
            k: run.get(k)
            for k in MUST_MATCH + MUST_MATCH_EXACT
        }
    }


def ready_trunk(trunk: dict, job_dir: Path, run: dict) -> str | None:
    """The id of the training of `trunk` whose checkpoint job_dir holds at its step (its record
    the same experiment, changes, step, corpus and GPU as `run`'s), else None."""
    record = job_dir / TRUNK_RECORD
    if not record.exists() or trunk["step"] not in _checkpoint_steps(job_dir):
        return None
    have = json.loads(record.read_text())
    same = {k: v for k, v in have.items() if k != "trained"} == _trunk_want(trunk, run)
    return have.get("trained") if same else None


def make_trunk(trunk: dict, job_dir: Path, run: dict) -> str:
    """Trains the bf16 trunk to its step in job_dir (the main stops there through
    train.sigterm_at_step and saves it), unless it already holds that step's checkpoint with
    a record of the same experiment, changes, step and corpus, GPU (`run`'s); the id of that
    training (`trained` in its record: a GPU does not repeat a training bit for bit, so the
    branches of one seed compare only where they share it)."""
    trained = ready_trunk(trunk, job_dir, run)
    if trained is not None:
        return trained
    if job_dir.exists():  # another trunk's, or its checkpoint is gone: train it again
        shutil.rmtree(job_dir)
    t0 = time.time()
    p = run_child(
        main_command(trunk["exp"], job_dir,
                     trunk["changes"] + [f"train.sigterm_at_step={trunk['step']}"]))
    if p.returncode != 128 + signal.SIGTERM or trunk["step"] not in _checkpoint_steps(job_dir):
        raise SystemExit(f"{trunk['name']} ({trunk['exp']} to step {trunk['step']}) did not stop "
                         f"there with its checkpoint (exit {p.returncode}):\n{p.stderr[-4000:]}")
    print(f"{trunk['name']}: {trunk['exp']} to step {trunk['step']} {time.time() - t0:.1f} s",
          flush=True)
    trained = uuid.uuid4().hex
    (job_dir / TRUNK_RECORD
     ).write_text(json.dumps({
         **_trunk_want(trunk, run), "trained": trained
     }, indent=1) + "\n")
    return trained


def set_aside_stale_branches(runs: list[dict], top: Path) -> list[str]:
    """Before the runs of one trunk (a seed's, with --branch_at) are read or trained: those
    recorded finished from another training of the trunk than the one the rest will start from
    (the trunk's checkpoint in top, or, where it is gone and one of them must still train, a new
    training) are moved aside to NAME.stale[.K] (their records kept) and train again, with a
    line naming them: a seed's runs compare only from one state. Returns their names."""
    trunk = runs[0]["trunk"]
    done = {r["name"]: finished(r, top / r["name"], say=False) for r in runs}  # train() says
    ids = {d.get("trunk_trained") for d in done.values() if d is not None}
    if None not in done.values() and len(ids) == 1 and None not in ids:
        return []  # all finished from one training: read them all
    live = ready_trunk(trunk, top / trunk["name"], runs[0])
    stale = [
        n for n, d in done.items()
        if d is not None and (live is None or d.get("trunk_trained") != live)
    ]
    for name in stale:
        k, aside = 0, top / f"{name}.stale"
        while aside.exists():
            k += 1
            aside = top / f"{name}.stale.{k}"
        (top / name).rename(aside)
    if stale:
        print(
            f"{', '.join(stale)}: finished from another training of {trunk['name']} than the "
            "one the other runs of its seed start from (a GPU does not repeat a training bit "
            "for bit): moved aside (NAME.stale) and trained again",
            flush=True)
    return stale


BRANCH_RECORD = "fp8_quality_branch.json"  # what a branch started as: its run and its trunk


def start_branch(run: dict, job_dir: Path, trunk_dir: Path) -> bool:
    """Makes job_dir its trunk's job directory (config, metrics to the trunk's step, event
    files, and the checkpoint, hard-linked: no second copy of a state that can be 31 GB; the
    branch writes its own checkpoints beside it), unless it holds a checkpoint of a branch
    started as this one (the same run from the same trunk), which then resumes. True where it
    made the directory anew (the branch's first start), False where the branch resumes."""
    started = {
        "exp": run["exp"],
        "changes": run["changes"],
        "trunk": json.loads((trunk_dir / TRUNK_RECORD).read_text())
    }
    record = job_dir / BRANCH_RECORD
    if _checkpoint_steps(job_dir) and record.exists() and \
            json.loads(record.read_text()) == started:
        return False
    if job_dir.exists():  # nothing to resume, or another run's: the branch starts anew
        shutil.rmtree(job_dir)

    copied = []

    def copy_or_link(src: str, dst: str):
        if Path(src).relative_to(trunk_dir).parts[0] == "checkpoints":
            try:
                os.link(src, dst)
                return dst
            except OSError as e:  # a file system without links: a full copy, said once
                if not copied:
                    print(
                        f"{job_dir.name}: the trunk's checkpoint is copied, not linked "
                        f"({e}): it takes its size again on the disk",
                        flush=True)
                copied.append(src)
        return shutil.copy2(src, dst)

    shutil.copytree(trunk_dir,
                    job_dir,
                    copy_function=copy_or_link,
                    ignore=shutil.ignore_patterns(TRUNK_RECORD))
    record.write_text(json.dumps(started, indent=1) + "\n")
    return True


def evaluated_at_branch(job_dir: Path, step: int) -> bool:
    """Whether a branch evaluated its trunk's state under its own config before its first step
    (train.eval_on_restore): its metrics.jsonl then holds a second eval line at the branch step
    after the trunk's (which read_metrics, keeping the last, reads as the run's own)."""
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    at = [
        r for r in map(json.loads, filter(str.strip, lines))
        if r["kind"] == "eval" and r["step"] == step
    ]
    return len(at) > 1


def drop_trunk_checkpoints(trunk_dir: Path):
    """A trunk whose branches have all finished keeps its record and curves, not its
    checkpoint (the same command again trains it anew where a new run needs it)."""
    shutil.rmtree(trunk_dir / "checkpoints", ignore_errors=True)
