"""FP8 training quality: a bf16 experiment and its FP8 twin (the same seed, data and steps; the
expert GEMMs in bf16 or in blockwise FP8) trained by the experiment main, held-out losses
compared at every evaluation; and FP8 variants that change one thing at a time.

    python -m benchmarks.fp8_quality [--base configs.experiments.TinyBf16]
        [--fp8 configs.experiments.TinyFp8] [--steps N] [--eval_every N]
        [--data PATH | --stdlib_corpus FILE]
        [--fdl_set PATH=VALUE ...] [--variant NAME PATH=VALUE [PATH=VALUE ...]] ...
        [--control NAME PATH=VALUE [PATH=VALUE ...]] ... [--seeds N]
        [--max_gap 0.01] [--keep DIR [--keep_checkpoints]] [--out FILE.json]

Each run is `python -m experiments.main` in its own job directory (a temporary one unless
--keep DIR). --data, --steps, --eval_every and every --fdl_set apply to all runs; a --variant
is one more run of the --fp8 experiment with its own changes, e.g. the wgrads in bf16:

    --variant wgrad_bf16 "model.stacked_transformer_tpl.block.moe_layer_tpl.fp8_gemms='fwd+dgrad'"

and a --control one more run of the --base experiment with its own, meant to change only the
rounding (e.g. "...moe_layer_tpl.router_precision='float32'": the router's logits exact where
the GPU's default 'bf16x3' is within about 1e-5): its gap to base is how far two bf16 runs
drift apart from a perturbation that small, the noise floor the FP8 gaps are read against.
Where one run per format drifts more than the bound (on the Mixtral-like preset two FP8 runs
that differ that little ended 8% apart, docs/performance.md), --seeds N trains base and fp8 at N
initialization seeds each (the experiment's own, then train.seed=1 .. N-1: base.s1, fp8.s1,
...), and the check is the gap between the formats' mean held-out losses, the seeds' spread
and the per-seed gaps beside it (benchmarks.fp8_quality_report.seed_stats).

With --keep a run whose job directory already holds its final step is read, not trained
again (where its corpus size and GPU match this run's), and one cut short resumes from its
checkpoint: a set of runs longer than one sitting is
finished by running the same command again. A finished run's checkpoints are removed (its
curves and record stay; --keep_checkpoints keeps them): at the Mixtral-like preset each is
31 GB, and three of them filled the GPU machine's disk. The JSON is written after every run,
marked "complete": false until the last, so a set cut short keeps what finished.

Prints the held-out loss of every run at every evaluation, each run's relative gap to its bf16
run (the base, or for a run at train.seed=I, such as fp8.sI or a variant named V.sI, base.sI),
the same for the train cross-entropy's mean between evaluations (every run reads the same
batches: steadier than one held-out loss; benchmarks.fp8_quality_report), each run's mean
router entropy between evaluations (near 0 the routing is frozen and runs drift apart), the
corpus and how much of it the runs read; writes the JSON (the curves, the gaps, date, commit
and GPU).
The check: the --fp8 run's held-out loss within --max_gap (relative) of the base at every
evaluation after step 0 (with --seeds N > 1: the mean over the fp8 runs within --max_gap of the
mean over the base runs) (PASS / FAIL; exit 1 on FAIL). On a CPU the FP8 runs use the pure-JAX
emulation of the FP8 GEMMs (the same arithmetic as the kernels, up to summation order).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.job import jobdir
from benchmarks.corpus import data_bytes, stdlib_corpus
from benchmarks.fp8_quality_report import compare, read_share, table
from experiments.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
_DATA_LINE = re.compile(r"^data: .*?([\d,]+) tokens \(([\d,]+) bytes\)", re.M)
CHILD_SAVE_S = 300  # how long a stopped main may take to save its step
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="configs.experiments.TinyBf16", help="the bf16 experiment")
    ap.add_argument("--fp8", default="configs.experiments.TinyFp8", help="its FP8 twin")
    ap.add_argument("--steps",
                    type=int,
                    default=None,
                    help="train.num_steps (default: the "
                    "experiment's)")
    ap.add_argument("--eval_every",
                    type=int,
                    default=None,
                    help="train.eval_every (default: "
                    "the experiment's)")
    ap.add_argument("--data",
                    default=None,
                    help="data.path of every run (a file or folder of "
                    "text: a corpus the runs read at most once compares the formats fairly)")
    ap.add_argument("--stdlib_corpus",
                    default=None,
                    metavar="FILE",
                    help="write this Python's standard library sources as one text file here "
                    "(if absent) and use it as --data: a corpus every machine can make, about "
                    "28 MB on Python 3.11")
    ap.add_argument("--fdl_set",
                    action="append",
                    default=[],
                    metavar="PATH=VALUE",
                    help="a config change of every run (experiments.main's --fdl_set)")
    ap.add_argument("--variant",
                    action="append",
                    nargs="+",
                    default=[],
                    metavar="NAME PATH=VALUE",
                    help="one more run of --fp8 with these changes, named NAME")
    ap.add_argument("--control",
                    action="append",
                    nargs="+",
                    default=[],
                    metavar="NAME PATH=VALUE",
                    help="one more run of --base with these changes (the same arithmetic "
                    "rounded otherwise, e.g. router_precision='float32'): its gap to base is "
                    "the runs' noise floor")
    ap.add_argument("--seeds",
                    type=int,
                    default=1,
                    help="train base and fp8 at this many initialization seeds each (the "
                    "experiment's, then train.seed=1..N-1) and check the gap of their means")
    ap.add_argument("--max_gap", type=float, default=0.01, help="relative held-out loss gap")
    ap.add_argument("--keep",
                    default=None,
                    help="job directories under this folder (runs "
                    "found finished there are read, not trained again)")
    ap.add_argument("--keep_checkpoints",
                    action="store_true",
                    help="keep a finished run's checkpoints (removed by default)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_quality.json"))
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: give 1 or more (1: one run per format)")
    names = [name for name, _, _ in format_runs(args.seeds)]
    for flag, given in (("--variant", args.variant), ("--control", args.control)):
        for v in given:
            name, changes = v[0], v[1:]
            if not _NAME.match(name) or "=" in name:
                ap.error(f"{flag} {name!r}: the first value is the run's name (letters, digits, "
                         "'_', '.', '-'), then its PATH=VALUE changes")
            if not changes or any("=" not in c for c in changes):
                ap.error(f"{flag} {name}: {changes or 'nothing'}: give one or more PATH=VALUE "
                         "changes after the name")
            names.append(name)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        ap.error(f"--variant and --control names must differ from each other and from base, "
                 f"fp8 (and the --seeds runs base.sI, fp8.sI): {dup}")
    for c in args.fdl_set:
        if "=" not in c:
            ap.error(f"--fdl_set {c!r}: give PATH=VALUE")
    if args.stdlib_corpus is not None:
        if args.data is not None:
            ap.error("give --data or --stdlib_corpus, not both")
        args.data = str(stdlib_corpus(Path(args.stdlib_corpus)))
    if args.data is not None and not Path(args.data).exists():
        ap.error(f"--data {args.data!r}: no such file or folder")
    return args


def format_runs(seeds: int) -> list[tuple[str, str, list[str]]]:
    """(name, group, own changes) of the two formats' runs in run order: base and fp8 at the
    experiment's seed, then base.sI and fp8.sI at train.seed=I for I = 1 .. seeds-1."""
    runs = [("base", "base", []), ("fp8", "fp8", [])]
    for i in range(1, seeds):
        runs += [(f"{g}.s{i}", g, [f"train.seed={i}"]) for g in ("base", "fp8")]
    return runs


def plan_runs(args) -> list[dict]:
    """[{name, exp, changes, own}] in run order: base, fp8, with --seeds N > 1 base.sI and
    fp8.sI for I = 1 .. N-1 (train.seed=I), each control (of --base, marked control=True), then
    each variant (of --fp8); `changes` every --fdl_set the run gets, `own` the control's,
    variant's or seed's (none for base and fp8), `group` 'base' or 'fp8' for the runs of those
    two formats (seeds included), `data_bytes` the corpus's size."""
    common = list(args.fdl_set)
    if args.data is not None:
        common.append(f"data.path={str(Path(args.data).resolve())!r}")
    if args.steps:
        common.append(f"train.num_steps={args.steps}")
    if args.eval_every:
        common.append(f"train.eval_every={args.eval_every}")
    size = data_bytes(args.data)
    exps = {"base": args.base, "fp8": args.fp8}
    runs = [
        dict(name=name, exp=exps[g], changes=common + own, own=own, group=g)
        for name, g, own in format_runs(args.seeds)
    ]
    runs += [  # the noise floor before the variants: it is what their gaps are read against
        dict(name=v[0], exp=args.base, changes=common + list(v[1:]), own=list(v[1:]), control=True)
        for v in args.control
    ]
    runs += [
        dict(name=v[0], exp=args.fp8, changes=common + list(v[1:]), own=list(v[1:]))
        for v in args.variant
    ]
    return [dict(r, data_bytes=size) for r in runs]


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


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


RECORD = "fp8_quality_run.json"  # a finished run's result, in its job directory
# what a recorded run must share with this one beyond its experiment and changes: the corpus
# behind the same data.path (a standard library topped up or not) and the GPU it ran on
MUST_MATCH = ("data_bytes", "accelerator")


def finished(run: dict, job_dir: Path) -> dict | None:
    """The result a finished run recorded in job_dir (RECORD), if it is this run's (the same
    experiment and changes), else None."""
    try:
        got = json.loads((job_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if (got.get("exp"), got.get("changes")) != (run["exp"], run["changes"]):
        return None
    for key in MUST_MATCH:  # absent from records made before they were recorded
        if got.get(key) is not None and run.get(key) is not None and got[key] != run[key]:
            print(
                f"{run['name']}: the run in {job_dir} had {key}={got[key]!r}, this one "
                f"{run[key]!r}: training it again",
                flush=True)
            return None
    got["heldout_loss"] = {int(k): v for k, v in got["heldout_loss"].items()}
    metrics = job_dir / "metrics.jsonl"
    recs = None
    for key in CURVES:
        if key in got:
            got[key] = {int(k): v for k, v in got[key].items()}
        else:  # recorded before this curve was: its metrics hold it, where they are kept
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
    in job_dir, whose checkpoints go unless keep_checkpoints."""
    done = finished(run, job_dir)
    if done is not None:
        print(f"{run['name']}: read the finished run in {job_dir}", flush=True)
        # this plan's role for it (a record made before `group` was recorded has none)
        return {**done, **{k: run[k] for k in ("group", "control") if k in run}}
    cmd = [
        sys.executable, "-m", "experiments.main", f"--exp={run['exp']}", f"--job_log_dir={job_dir}",
        "--no_progress"
    ] + [f"--fdl_set={c}" for c in run["changes"]]
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
    (job_dir / RECORD).write_text(json.dumps(result, indent=1) + "\n")
    if not keep_checkpoints:
        shutil.rmtree(job_dir / "checkpoints", ignore_errors=True)
    return result


def _first_line(cmd: list[str]):
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = p.stdout.strip().splitlines()
    return lines[0].strip() if p.returncode == 0 and lines else None


def accelerator():
    """The first GPU's name as nvidia-smi gives it (the parent never starts JAX: the runs
    need the whole GPU), or None where there is none."""
    return _first_line(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])


def commit():
    """The checkout's commit ('+changes' where tracked files differ from it), or None outside a
    git checkout."""
    head = _first_line(["git", "rev-parse", "--short", "HEAD"])
    changed = _first_line(["git", "status", "--porcelain", "--untracked-files=no"])
    return None if head is None else head + ("+changes" if changed else "")


def write_json(path: str, out: dict):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # timeout(1)'s signal: the child saves first
    gpu = accelerator()
    plan = [dict(r, accelerator=gpu) for r in plan_runs(args)]
    command = "python -m benchmarks.fp8_quality " + shlex.join(sys.argv[1:] if argv is
                                                               None else argv)
    head = {
        "what": "held-out loss, bf16 vs blockwise FP8 expert GEMMs (and bf16 controls, FP8 "
        "variants), same seed/data/steps",
        "machine": platform.node(),
        "accelerator": plan[0]["accelerator"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": commit(),
        "python": platform.python_version(),
        "command": command,
    }
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(args.keep or tmp)
        runs = []
        for run in plan:
            runs.append(train(run, top / run["name"], args.keep_checkpoints))
            print(f"{run['name']}: {run['exp']} {' '.join(run['own'])}"
                  f" {runs[-1]['seconds']} s",
                  flush=True)
            if len(runs) < len(plan):  # what finished so far, should a later run fail
                write_json(args.out, {**head, "complete": False, "runs": runs})
    result = compare(runs, args.max_gap)
    if not result["steps"]:
        raise SystemExit("the runs share no eval step: compare them with the same "
                         "--steps and --eval_every")
    print(table(runs, result))
    seen = read_share(runs[0])
    if seen is not None:
        print(f"corpus: {runs[0]['corpus_tokens']:,} tokens ({runs[0]['corpus_bytes']:,} bytes);"
              f" {runs[0]['final_step']} steps of {runs[0]['tokens_per_step']:,} tokens read "
              f"{seen:.2f} of it" + ("" if seen <= 1 else " (more than once: the runs repeat "
                                     "examples; a larger --data compares the formats better)"))
    worst, got, seeds = result["max_abs_gap_fp8"], result["max_abs_gap_checked"], result["seeds"]
    what = (f"fp8 against base over {seeds['seeds']} seeds each: largest |gap of the mean "
            "held-out losses|" if seeds else "fp8 against base: largest |gap|")
    if got is None:
        print(f"{what}: no eval after step 0 (FAIL)")
    else:
        alone = f"; the seed-0 pair alone {worst:.3%}" if seeds else ""
        print(f"{what} after step 0 {got:.3%} (<= {args.max_gap:.2%} at every eval: "
              f"{'PASS' if result['pass'] else 'FAIL'}){alone}")
    if result["noise_floor"] is not None:
        print(f"noise floor: the controls' largest |gap| after step 0 {result['noise_floor']:.3%}"
              " (bf16 against bf16 rounded otherwise)")
    if result["noise_floor_train"] is not None:
        fp8_train = max(abs(g) for g in result["train_window_gaps"]["fp8"].values())
        print(f"train cross-entropy means: fp8's largest |gap| {fp8_train:.3%}, the controls' "
              f"{result['noise_floor_train']:.3%}")
    write_json(
        args.out,
        {
            **head,
            "complete": True,
            "runs": runs,
            "steps": result["steps"],
            "relative_gaps": result["gaps"],
            "gap_references": result["gap_references"],
            "max_abs_gap_fp8": worst,
            "seeds": result["seeds"],
            "max_abs_gap_checked": result["max_abs_gap_checked"],
            "noise_floor": result["noise_floor"],
            "train_windows": result["train_windows"],
            "train_window_gaps": result["train_window_gaps"],
            "router_entropy_windows": result["router_entropy_windows"],
            "noise_floor_train": result["noise_floor_train"],
            "max_gap": args.max_gap,
            "pass": result["pass"],
            "corpus_read": seen,  # the share of the corpus's tokens the base run's steps read
        })
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
