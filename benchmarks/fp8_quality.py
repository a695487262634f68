"""FP8 training quality: a bf16 experiment and its FP8 twin (the same seed, data and steps; the
expert GEMMs in bf16 or in blockwise FP8) trained by the experiment main, held-out losses
compared at every evaluation; and FP8 variants that change one thing at a time.

    python -m benchmarks.fp8_quality [--base configs.experiments.TinyBf16]
        [--fp8 configs.experiments.TinyFp8] [--steps N] [--eval_every N]
        [--data PATH | --stdlib_corpus FILE]
        [--fdl_set PATH=VALUE ...] [--variant NAME PATH=VALUE [PATH=VALUE ...]] ...
        [--control NAME PATH=VALUE [PATH=VALUE ...]] ... [--seeds N]
        [--branch_at STEP] [--max_gap 0.01] [--keep DIR [--keep_checkpoints]]
        [--out FILE.json]
    python -m benchmarks.fp8_quality --report FILE.json [--max_gap 0.01] [--out FILE.json]

Each run is `python -m experiments.main` in its own job directory (a temporary one unless
--keep DIR; benchmarks.fp8_quality_runs). --data, --steps, --eval_every and every --fdl_set
apply to all runs; a --variant is one more run of the --fp8 experiment with its own changes,
e.g. the wgrads in bf16:

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

--branch_at STEP starts every run from its seed's bf16 trunk: the base's config trained to
STEP (one of the evaluations) in the job directory trunk (trunk.sI at train.seed=I), whose
checkpoint each of them takes up under its own config (experiments.main's
--allow_config_change), so that runs which drift apart after the router has settled (the
Mixtral-like preset's, docs/performance.md) are compared from one state and their gaps are
what each format does after STEP. The base run of a seed is its trunk continued: a base
trained from step 0 would not start where the branches do, since a GPU does not reproduce a
run bit for bit without XLA's deterministic ops (two H100 runs of the Mixtral-like preset part
at step 3 and are 0.3-0.8% apart at step 100). Up to STEP a seed's runs share the trunk's
curves, so the check reads the evaluations after it. At STEP each branch first evaluates the
trunk's state under its own config (experiments.main's train.eval_on_restore, on its first
start): the gap there is the format's effect on the same weights (`evaluated_at_branch`). The trunk's checkpoint is hard-linked into each branch's job
directory, and removed (its record and curves kept) once its last branch finished. Each
training of a trunk has an id (`trained` in its record, `trunk_trained` in each branch's), and
a seed's finished runs are read back only where they branched from the training the others
start from: a run from another (say, the trunk trained anew for a new variant after its
checkpoint went) is moved aside to NAME.stale and trained again.

With --keep a run whose job directory already holds its final step is read, not trained
again (where its corpus size, GPU and XLA_FLAGS match this run's), and one cut short resumes from its
checkpoint: a set of runs longer than one sitting is
finished by running the same command again. A finished run's checkpoints are removed (its
curves and record stay; --keep_checkpoints keeps them): at the Mixtral-like preset each is
31 GB, and three of them filled the GPU machine's disk. The JSON is written after every run,
marked "complete": false until the last, so a set cut short keeps what finished, and
--report FILE compares those runs without training (a seed's run whose other format did not
finish is named and left out).

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
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.corpus import data_bytes, stdlib_corpus
from benchmarks.fp8_quality_report import (compare, paired, record, recorded_runs, seed_of, summary,
                                           table)
from benchmarks.fp8_quality_runs import drop_trunk_checkpoints, set_aside_stale_branches, train

ROOT = Path(__file__).resolve().parent.parent
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
    ap.add_argument("--branch_at",
                    type=int,
                    default=0,
                    metavar="STEP",
                    help="every run, the base runs too, starts from its seed's bf16 trunk "
                    "(the base's config trained to STEP, an eval step), so that its gaps are "
                    "what it does after STEP (0: every run trains from step 0)")
    ap.add_argument("--max_gap", type=float, default=0.01, help="relative held-out loss gap")
    ap.add_argument("--keep",
                    default=None,
                    help="job directories under this folder (runs "
                    "found finished there are read, not trained again)")
    ap.add_argument("--keep_checkpoints",
                    action="store_true",
                    help="keep a finished run's checkpoints (removed by default)")
    ap.add_argument("--report",
                    default=None,
                    metavar="FILE.json",
                    help="train nothing: compare the runs this results JSON recorded (a set "
                    "cut short: those that finished), with --max_gap, to --out")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_quality.json"))
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report is not None:
        defaults = vars(ap.parse_args([]))
        given = [
            f"--{k}" for k, v in vars(args).items()
            if k not in ("report", "max_gap", "out") and v != defaults[k]
        ]
        if given:
            ap.error(f"--report {args.report} compares recorded runs: {', '.join(given)} "
                     "would plan runs (give only --max_gap and --out with it)")
        if not Path(args.report).is_file():
            ap.error(f"--report {args.report!r}: no such file")
        return args
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: give 1 or more (1: one run per format)")
    if args.branch_at:
        if args.steps is None or args.eval_every is None:
            ap.error(f"--branch_at {args.branch_at}: give --steps and --eval_every with it "
                     "(the branch step must be one of the evaluations before the last step)")
        if not 0 < args.branch_at < args.steps or args.branch_at % args.eval_every:
            ap.error(f"--branch_at {args.branch_at}: give a multiple of --eval_every "
                     f"{args.eval_every} between 0 and --steps {args.steps}, or 0 (no branch)")
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
    runs = [dict(r, data_bytes=size) for r in runs]
    return branched(runs, args.branch_at) if args.branch_at else runs


def trunk_name(seed: int | None) -> str:
    return "trunk" if not seed else f"trunk.s{seed}"


def branched(runs: list[dict], step: int) -> list[dict]:
    """The runs with --branch_at STEP: each run, the base runs too, gets `branch_at` and its
    `trunk` {name, exp, changes, step}: the bf16 run of its seed (base's config, or base.sI's
    for a run at train.seed=I) trained to STEP, whose job directory it starts from; in the
    order trunk, base, the other runs of its seed, trunk.s1, ... (one trunk at a time holds a
    checkpoint on the disk). A seed's base run is its trunk continued under the same config,
    not a run trained from step 0: training on a GPU is not bit-reproducible (on an H100 two
    runs of the Mixtral-like preset part at step 3 and are 0.3-0.8% apart at step 100), so
    only a branch of the same trunk starts where the others do."""
    bases = {seed_of(r): r for r in runs if r.get("group") == "base"}
    out = []
    for key, base in bases.items():
        trunk = dict(name=trunk_name(key), exp=base["exp"], changes=base["changes"], step=step)
        out += [dict(r, branch_at=step, trunk=trunk) for r in runs if seed_of(r) == key]
    orphans = [r["name"] for r in runs if seed_of(r) not in bases]
    if orphans:
        raise SystemExit(f"--branch_at {step}: {orphans} run at a seed with no base run to branch "
                         "from (train.seed=I needs base.sI: give --seeds I+1 or more)")
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


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
    if args.report:
        return report_recorded(args.report, args.max_gap, args.out)
    signal.signal(signal.SIGTERM, _interrupt)  # timeout(1)'s signal: the child saves first
    gpu = accelerator()
    xla_flags = os.environ.get("XLA_FLAGS") or None  # the runs inherit them
    plan = [dict(r, accelerator=gpu, xla_flags=xla_flags) for r in plan_runs(args)]
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
        "branch_at": args.branch_at or None,
        "xla_flags": xla_flags,
    }
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(args.keep or tmp)
        runs = []
        branches = {}  # trunk name: the plan indices of its runs (a seed's, in run order)
        for i, r in enumerate(plan):
            if "trunk" in r:
                branches.setdefault(r["trunk"]["name"], []).append(i)
        for i, run in enumerate(plan):
            mine = branches.get(run["trunk"]["name"]) if "trunk" in run else None
            if mine and i == mine[0]:
                set_aside_stale_branches([plan[j] for j in mine], top)
            runs.append(train(run, top / run["name"], args.keep_checkpoints))
            if mine and i == mine[-1] and not args.keep_checkpoints:
                drop_trunk_checkpoints(top / run["trunk"]["name"])
            print(f"{run['name']}: {run['exp']} {' '.join(run['own'])}"
                  f" {runs[-1]['seconds']} s",
                  flush=True)
            if len(runs) < len(plan):  # what finished so far, should a later run fail
                write_json(args.out, {**head, "complete": False, "runs": runs})
    return report({**head, "complete": True}, runs, args.max_gap, args.out)


def report(head: dict, runs: list[dict], max_gap: float, out: str) -> int:
    """Prints the runs' comparison (fp8_quality_report: tables, then the check) and writes its
    JSON to out; 0 where the check passes, else 1."""
    result = compare(runs, max_gap)
    if not result["steps"]:
        raise SystemExit("the runs share no eval step: compare them with the same "
                         "--steps and --eval_every")
    print(table(runs, result))
    print("\n".join(summary(runs, result, max_gap)))
    write_json(out, record(head, runs, result, max_gap))
    return 0 if result["pass"] else 1


def report_recorded(path: str, max_gap: float, out: str) -> int:
    """--report FILE: the comparison of the runs a results JSON recorded (a set cut short: the
    runs that finished, less those whose seed lacks the other format's run, each named)."""
    head, runs = recorded_runs(path)
    kept, left = paired(runs)
    if not kept:
        raise SystemExit(f"{path}: no seed has both a base and an fp8 run among "
                         f"{[r['name'] for r in runs]}")
    if left:
        print(f"{path}: left out {', '.join(left)} (no finished run of the other format at "
              "its seed)")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    head = {**head, "reported": {"from": path, "date": now, "left_out": left}}
    return report(head, kept, max_gap, out)


if __name__ == "__main__":
    sys.exit(main())
