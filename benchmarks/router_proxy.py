r"""A CPU stand-in for the Mixtral-like preset's router, and the report of its runs.

``mixtral_moe_gpu``'s router settles within its first hundred steps (docs/performance.md): the
mean entropy of softmax(router logits) falls from about 1.75 nats to 0.02-0.23, each token then
goes to one expert, and the held-out loss at 500 steps follows that early routing (two bf16
seeds up to 8% apart). The preset needs a GPU. ``MixtralRouterProxy`` keeps what the router
sees, the width d_model = 4096 (its fan-in) and the preset's schedule (learning rate 1e-4, 100
warmup steps, 2 layers of 8 experts, top-2), and shrinks everything else so that 150 steps run
on two CPU cores in about 13 minutes: 4 query heads and 1 key/value head of 128, experts and
dense FFN of 256, sequences of 256, 4 of them a step (1,024 tokens), float32, no remat.

Runs (one job directory each; ``--fdl_set`` as the main job takes it)::

  python -m experiments.main --fdl_config=benchmarks.router_proxy.mixtral_router_proxy \
      --job_log_dir DIR [--fdl_set=train.seed=1] \
      [--fdl_set=model.stacked_transformer_tpl.block.moe_layer_tpl.router_init_scale=0.1]

A run branched at step S from another's state (as benchmarks.fp8_quality --branch_at
compares the formats): the trunk trained to S (``--fdl_set=train.sigterm_at_step=S``), its job
directory copied, and the copy run with its own ``--fdl_set`` changes and
``--allow_config_change``.

Report (held-out loss at every evaluation, the train cross-entropy's and each layer's router
entropy's means between evaluations, the gaps of the first two to the first run's, or for a run
at seed N to the first run's seed N, and the spread of runs that differ by seed only)::

  python -m benchmarks.router_proxy NAME=DIR [NAME=DIR ...] [--out FILE.json]

A run named ``X.sN`` is seed N of ``X``; the spread of a group is (max - min) / mean of its
held-out losses at an evaluation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

from benchmarks.fp8_quality import commit, write_json
from benchmarks.fp8_quality_report import window_means
from configs.registry import config_function
from configs.single_gpu import MixtralMoeGpu
from experiments.train.metrics import read_metrics


class MixtralRouterProxy(MixtralMoeGpu):
    """MixtralMoeGpu's router width and schedule at a size two CPU cores train (the module's
    docstring says what is kept)."""
    NUM_HEADS = 4
    NUM_KV_HEADS = 1
    HIDDEN_DIMS = 256
    MOE_HIDDEN_DIMS = 256
    SEQ_LEN = 256
    BATCH_SIZE = 4
    FPROP_DTYPE = "float32"
    REMAT = False
    NUM_STEPS = 150
    EVAL_EVERY = 50
    CHECKPOINT_EVERY = 1000
    SUMMARY_EVERY = 1


# --fdl_config=benchmarks.router_proxy.mixtral_router_proxy (not registered: --list_experiments
# and the tests that read the registry see the presets only).
mixtral_router_proxy = config_function(MixtralRouterProxy)


def read_run(name: str, job_dir: Path) -> dict:
    """One run's held-out losses by eval step and its train records' cross-entropy and router
    entropies."""
    path = Path(job_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{name}={job_dir}: no metrics.jsonl there (a job directory of "
                         "experiments.main)")
    recs = read_metrics(path)
    train = [r for r in recs if r["kind"] == "train"]
    layers = sorted({k
                     for r in train
                     for k in r if k.startswith("router_entropy_layer_")},
                    key=lambda k: int(k.rsplit("_", 1)[1]))
    return {
        "name": name,
        "job_dir": str(job_dir),
        "heldout_loss": {
            r["step"]: r["heldout_loss"]
            for r in recs if r["kind"] == "eval"
        },
        "train_xent": {
            r["step"]: r["xent"]
            for r in train if "xent" in r
        },
        "entropy": {
            key: {
                r["step"]: r[key]
                for r in train if key in r
            }
            for key in ["router_entropy"] + layers
        },
    }


def windows(run: dict, steps: list[int]) -> dict[int, dict[str, float]]:
    """{eval step s: {entropy key: mean over the train steps (previous eval, s]}}
    (fp8_quality_report.window_means, one curve at a time)."""
    out = {s: {} for s in steps if s > 0}
    for key in run["entropy"]:
        for s, (mean, ) in window_means([run["entropy"]], steps, key).items():
            out[s][key] = mean
    return out


def seed_name(name: str) -> tuple[str, str | None]:
    """(X, N) of a run named X.sN (seed N of X), else (name, None)."""
    stem, _, seed = name.rpartition(".s")
    return (stem, seed) if stem and seed.isdigit() else (name, None)


def spreads(runs: list[dict], steps: list[int]) -> dict[str, dict[int, float]]:
    """{group: {eval step: (max - min) / mean of the group's held-out losses}} for the groups of
    two or more runs that differ by seed only (``X`` and ``X.sN``)."""
    groups = {}
    for r in runs:
        groups.setdefault(seed_name(r["name"])[0], []).append(r)
    out = {}
    for key, group in groups.items():
        if len(group) < 2:
            continue
        out[key] = {}
        for s in steps:
            vals = [g["heldout_loss"][s] for g in group if s in g["heldout_loss"]]
            if len(vals) == len(group):
                out[key][s] = (max(vals) - min(vals)) / (sum(vals) / len(vals))
    return out


def references(names: list[str]) -> dict[str, str]:
    """{name: the run its gaps are read against}: a run at seed N (X.sN) against the first
    run's seed N (F.sN) where there is one, every other run against the first run F."""
    first, out = names[0], {}
    for n in names:
        seed = seed_name(n)[1]
        own = f"{first}.s{seed}"
        out[n] = own if seed is not None and own in names and n != own else first
    return out


def report(runs: list[dict]) -> tuple[dict, str]:
    steps = sorted(set.intersection(*(set(r["heldout_loss"]) for r in runs)))
    ref = references([r["name"] for r in runs])
    index = {r["name"]: i for i, r in enumerate(runs)}  # of each run and so of its reference
    gaps = {
        r["name"]: {
            s: r["heldout_loss"][s] / runs[index[ref[r["name"]]]]["heldout_loss"][s] - 1
            for s in steps
        }
        for r in runs[1:]
    }
    win = {r["name"]: windows(r, steps) for r in runs}
    spread = spreads(runs, steps)
    lines = [
        f"held-out loss (gap to {runs[0]['name']}, or for a run at seed N to "
        f"{runs[0]['name']}.sN where there is one):",
        "| step | " + " | ".join(r["name"] for r in runs) + " |", "|---|" + "---|" * len(runs)
    ]
    lines += [
        f"| {s} | {runs[0]['heldout_loss'][s]:.4f} | " +
        " | ".join(f"{r['heldout_loss'][s]:.4f} ({gaps[r['name']][s]:+.2%})"
                   for r in runs[1:]) + " |" for s in steps
    ]
    lines += [
        "router entropy (nats; ln E is uniform), mean over the steps since the last eval, "
        "all layers [each layer]:", "| steps | " + " | ".join(r["name"] for r in runs) + " |",
        "|---|" + "---|" * len(runs)
    ]
    prev = 0
    for s in steps[1:] if steps and steps[0] == 0 else steps:
        cells = []
        for r in runs:
            w = win[r["name"]].get(s, {})
            per = [f"{v:.2f}" for k, v in w.items() if k != "router_entropy"]
            cells.append(f"{w.get('router_entropy', float('nan')):.3f}" +
                         (f" [{', '.join(per)}]" if per else ""))
        lines.append(f"| {prev + 1}-{s} | " + " | ".join(cells) + " |")
        prev = s
    xent = window_means(runs, steps)  # over the train steps every run recorded
    xent_gaps = {
        r["name"]: {
            s: m[i] / m[index[ref[r["name"]]]] - 1
            for s, m in xent.items()
        }
        for i, r in enumerate(runs) if i
    }
    if xent:
        lines += [
            "train cross-entropy, mean over the steps since the last eval (gaps as above):",
            "| steps | " + " | ".join(r["name"] for r in runs) + " |", "|---|" + "---|" * len(runs)
        ]
        prev = 0
        for s, means in xent.items():
            lines.append(f"| {prev + 1}-{s} | {means[0]:.4f} | " +
                         " | ".join(f"{m:.4f} ({xent_gaps[r['name']][s]:+.2%})"
                                    for m, r in zip(means[1:], runs[1:])) + " |")
            prev = s
    for key, by_step in spread.items():
        lines.append(f"spread of {key} over its seeds (max - min) / mean: " +
                     ", ".join(f"step {s} {100 * v:.2f}%" for s, v in by_step.items() if s))
    result = {
        "steps": steps,
        "heldout_loss": {
            r["name"]: r["heldout_loss"]
            for r in runs
        },
        "router_entropy_windows": win,
        "train_xent_windows": {
            r["name"]: {
                s: means[i]
                for s, means in xent.items()
            }
            for i, r in enumerate(runs)
        },
        "seed_spreads": spread,
        "gap_references": {
            r["name"]: ref[r["name"]]
            for r in runs[1:]
        },
        "heldout_gaps": gaps,
        "train_xent_gaps": xent_gaps,
    }
    return result, "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs",
                    nargs="+",
                    metavar="NAME=DIR",
                    help="a run's name and its job directory (X.sN: seed N of X)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--note", default=None, help="a note for the JSON (how the runs were made)")
    args = ap.parse_args(argv)
    for spec in args.runs:
        if "=" not in spec or not spec.split("=", 1)[0]:
            ap.error(f"run {spec!r}: expected NAME=DIR (e.g. base=/tmp/proxy/base)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [read_run(*spec.split("=", 1)) for spec in args.runs]
    result, text = report(runs)
    print(text)
    if args.out:
        write_json(
            args.out, {
                "what": "MixtralRouterProxy on the CPU: held-out loss and router entropy by "
                "layer, runs that differ by seed or router init",
                "machine": platform.machine(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                "commit": commit(),
                "runs": {
                    r["name"]: r["job_dir"]
                    for r in runs
                },
                **result,
                **({
                    "note": args.note
                } if args.note else {}),
            })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
