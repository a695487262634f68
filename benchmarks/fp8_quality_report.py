"""What benchmarks.fp8_quality reports of its runs: the held-out gaps to each run's bf16 run
(references) at every evaluation and the check, the controls' noise floor, the train
cross-entropy's means between evaluations and their gaps, the router entropy's means between
evaluations, with --seeds the two formats' means over their seeds (seed_stats), the tables it
prints and the share of the corpus the runs read, the results JSON, and the runs of one read
back (recorded_runs, paired)."""

from __future__ import annotations

import json
from math import sqrt
from pathlib import Path
from statistics import fmean, stdev, variance

from benchmarks.fp8_quality_runs import int_steps

# a results JSON's fields that say where and how its runs were made
HEAD = ("what", "machine", "accelerator", "date", "commit", "python", "command", "branch_at",
        "xla_flags", "complete")


def read_share(run: dict):
    """The share of the corpus's tokens a run's steps read (None where the main printed no
    data line), over its train and held-out tokens alike."""
    if not run["corpus_tokens"]:
        return None
    return run["final_step"] * run["tokens_per_step"] / run["corpus_tokens"]


def window_means(runs: list[dict],
                 steps: list[int],
                 curve: str = "train_xent") -> dict[int, list[float]]:
    """{s: each run's mean of its train curve (by default the cross-entropy) over the steps
    (previous eval step, s]} for every eval step s after 0, over the train steps every run
    recorded: a mean of many steps on the same batches, steadier than one held-out loss (none
    where a run has no such curve)."""
    out, prev = {}, 0
    for s in steps:
        if s <= 0:
            continue
        common = set(range(prev + 1, s + 1)).intersection(*(r.get(curve, {}) for r in runs))
        if common:
            out[s] = [sum(r[curve][t] for t in common) / len(common) for r in runs]
        prev = s
    return out


def seed_stats(runs: list[dict], steps: list[int], means: dict[int, list[float]]) -> dict | None:
    """With more than one run of each format (group 'base' and 'fp8', paired by seed in run
    order), at every eval step: each format's mean held-out loss over its seeds, the relative
    gap of the fp8 mean to the base mean, the per-seed gaps (fp8 seed I against base seed I),
    each format's spread (its seeds' largest relative distance from their mean) and the
    standard error of the gap, as a share of the base mean: `gap_se` from each format's sample
    standard deviation (the runs of two formats drift apart independently after a few hundred
    steps), `paired_gap_se` from the per-seed gaps' (the runs of one seed share a state, as
    --branch_at's do); the same gap of the train cross-entropy's window means. None with one
    run per format."""
    by = {g: [i for i, r in enumerate(runs) if r.get("group") == g] for g in ("base", "fp8")}
    if len(by["base"]) < 2 or len(by["base"]) != len(by["fp8"]):
        return None
    out = {"seeds": len(by["base"]), "steps": {}, "train_windows": {}}
    for st in steps:
        loss = {g: [runs[i]["heldout_loss"][st] for i in idx] for g, idx in by.items()}
        mb, mf = fmean(loss["base"]), fmean(loss["fp8"])
        out["steps"][st] = {
            "base_mean": mb,
            "fp8_mean": mf,
            "gap_of_means": (mf - mb) / mb,
            "paired_gaps": [(f - b) / b for b, f in zip(loss["base"], loss["fp8"])],
            "base_spread": max(abs(v - mb) for v in loss["base"]) / mb,
            "fp8_spread": max(abs(v - mf) for v in loss["fp8"]) / mf,
        }
        n = len(loss["base"])
        out["steps"][st]["gap_se"] = sqrt((variance(loss["base"]) + variance(loss["fp8"])) / n) / mb
        out["steps"][st]["paired_gap_se"] = stdev(out["steps"][st]["paired_gaps"]) / sqrt(n)
    for st, m in means.items():
        mb, mf = (fmean([m[i] for i in by[g]]) for g in ("base", "fp8"))
        out["train_windows"][st] = {"base_mean": mb, "fp8_mean": mf, "gap_of_means": (mf - mb) / mb}
    return out


SEED = "train.seed="  # the own change that sets a run's initialization seed


def seed_of(run: dict) -> int | None:
    """The initialization seed a run's own changes set (train.seed=I), else None (the
    experiment's; train.seed=0 is that seed too: every experiment's SEED is 0)."""
    seeds = [c[len(SEED):] for c in run.get("own", []) if c.startswith(SEED)]
    return (int(seeds[-1]) or None) if seeds else None


def references(runs: list[dict]) -> list[int]:
    """The index of the bf16 run each run is read against: a run at seed I (its own
    train.seed=I, as the --seeds runs and variants named V.sI have) against the base run of that
    seed, where there is one, every other run against the first run, the base (the base runs of
    other seeds too: their gaps are the seeds' spread)."""
    own_base = {
        seed_of(r): i
        for i, r in enumerate(runs) if r.get("group") == "base" and seed_of(r) is not None
    }
    return [0 if r.get("group") == "base" else own_base.get(seed_of(r), 0) for r in runs]


def compare(runs: list[dict], max_gap: float) -> dict:
    """Each run's relative gap to its bf16 run (references: the base, or the base run of its
    own seed) at the common eval steps, the controls' largest (the noise floor), and the check
    (the 'fp8' run within max_gap at every step after 0, or with --branch_at after the branch
    step: `checked_steps`); beside them the same gaps of the train
    cross-entropy's mean over each eval interval (window_means) and their noise floor, which
    are reported, not checked. With runs of each format at several seeds (seed_stats) the check
    is the gap of the two formats' means."""
    steps = sorted(
        set(runs[0]["heldout_loss"]).intersection(*(r["heldout_loss"] for r in runs[1:])))
    ref = references(runs)
    gaps = {}
    for i, r in enumerate(runs[1:], 1):
        base = runs[ref[i]]["heldout_loss"]
        gaps[r["name"]] = {s: (r["heldout_loss"][s] - base[s]) / base[s] for s in steps}
    means = window_means(runs, steps)
    window_gaps = {
        r["name"]: {
            s: (m[i] - m[ref[i]]) / m[ref[i]]
            for s, m in means.items()
        }
        for i, r in enumerate(runs) if i > 0
    }
    # with --branch_at the steps up to the branch are the trunk's, shared by a seed's runs
    after = max((r.get("branch_at") or 0 for r in runs), default=0)
    checked = [s for s in steps if s > after]
    worst = max((abs(gaps["fp8"][s]) for s in checked), default=None)
    controls = [r["name"] for r in runs if r.get("control")]
    floor = max((abs(gaps[n][s]) for n in controls for s in checked), default=None)
    floor_train = max((abs(window_gaps[n][s]) for n in controls for s in means), default=None)
    seeds = seed_stats(runs, steps, means)
    checked_gap = worst
    if seeds is not None:
        checked_gap = max((abs(seeds["steps"][s]["gap_of_means"]) for s in checked), default=None)
    return {
        "steps": steps,
        "gaps": gaps,
        "max_abs_gap_fp8": worst,
        "noise_floor": floor,
        "seeds": seeds,
        "branch_at": after,
        "checked_steps": checked,
        "max_abs_gap_checked": checked_gap,
        "pass": checked_gap is not None and checked_gap <= max_gap,
        "train_windows": means,
        "train_window_gaps": window_gaps,
        "noise_floor_train": floor_train,
        # reported beside the losses: a router whose entropy falls near 0 routes each token to
        # one expert chosen early in training, and the runs then drift apart (docs/performance.md)
        "router_entropy_windows": window_means(runs, steps, "router_entropy"),
        "gap_references": {
            r["name"]: runs[ref[i]]["name"]
            for i, r in enumerate(runs) if i > 0
        },
    }


def table(runs: list[dict], result: dict) -> str:
    """The held-out losses and gaps by eval step; then, where the runs have train curves, the
    mean train cross-entropy over each eval interval and its gaps, and the mean router
    entropy."""
    names = [r["name"] for r in runs]
    refs = result.get("gap_references", {})
    head = " | ".join(names) + " | " + " | ".join(
        f"gap {n}" + (f" (to {refs[n]})" if refs.get(n, names[0]) != names[0] else "")
        for n in names[1:]) + " |"
    rule = "|---" * (2 * len(names)) + "|"
    lines = ["held-out loss:", "| step | " + head, rule]
    for s in result["steps"]:
        losses = " | ".join(f"{r['heldout_loss'][s]:.4f}" for r in runs)
        gaps = " | ".join(f"{result['gaps'][n][s]:+.2%}" for n in names[1:])
        lines.append(f"| {s} | {losses} | {gaps} |")
    if result.get("train_windows"):
        lines += [
            "train cross-entropy, mean over the steps since the last eval:", "| steps | " + head,
            rule
        ]
        for s, m in result["train_windows"].items():
            prev = max((t for t in result["steps"] if t < s), default=0)
            gaps = " | ".join(f"{result['train_window_gaps'][n][s]:+.2%}" for n in names[1:])
            lines.append(f"| {prev + 1}-{s} | " + " | ".join(f"{v:.4f}"
                                                             for v in m) + f" | {gaps} |")
    if result.get("router_entropy_windows"):
        lines += [
            "router entropy (nats; ln E is uniform), mean over the steps since the last eval:",
            "| steps | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"
        ]
        for s, m in result["router_entropy_windows"].items():
            prev = max((t for t in result["steps"] if t < s), default=0)
            lines.append(f"| {prev + 1}-{s} | " + " | ".join(f"{v:.3f}" for v in m) + " |")
    seeds = result.get("seeds")
    if seeds:
        lines += [
            f"over {seeds['seeds']} seeds each, held-out loss:",
            "| step | base mean | fp8 mean | gap of the means | per-seed gaps | base spread "
            "| fp8 spread | standard error of the gap (unpaired / paired) |",
            "|---|---|---|---|---|---|---|---|"
        ]
        for s, v in seeds["steps"].items():
            paired = ", ".join(f"{g:+.2%}" for g in v["paired_gaps"])
            lines.append(f"| {s} | {v['base_mean']:.4f} | {v['fp8_mean']:.4f} | "
                         f"{v['gap_of_means']:+.2%} | {paired} | {v['base_spread']:.2%} | "
                         f"{v['fp8_spread']:.2%} | {v['gap_se']:.2%} / "
                         f"{v['paired_gap_se']:.2%} |")
        for s, v in seeds["train_windows"].items():
            lines.append(f"train cross-entropy to step {s}: base mean {v['base_mean']:.4f}, "
                         f"fp8 mean {v['fp8_mean']:.4f}, gap of the means "
                         f"{v['gap_of_means']:+.2%}")
    return "\n".join(lines)


def summary(runs: list[dict], result: dict, max_gap: float) -> list[str]:
    """The lines printed under the tables: where the runs branched, the corpus and how much of
    it they read, the check (with --seeds its standard errors), the noise floors."""
    lines = []
    branch_at = result["branch_at"]
    if branch_at and runs[0].get("branch_at"):
        lines.append(
            f"every run branched at step {branch_at} from its seed's bf16 trunk (the base's "
            "config trained to that step; the base run is the trunk continued): up to it a "
            "seed's runs share the trunk's curves, so the check reads the evaluations after it")
    elif branch_at:  # a set planned before the base runs branched too
        lines.append(
            f"every run but the base runs branched at step {branch_at} from its seed's bf16 "
            "trunk; the base runs trained from step 0, so up to that step the branches' gaps "
            "are their trunk's against the base run's (not 0 where the GPU does not reproduce "
            "a run bit for bit), and the check reads the evaluations after it")
    at_branch = {
        r["name"]: result["gaps"][r["name"]][branch_at]
        for r in runs[1:] if r.get("evaluated_at_branch") and r["name"] in result["gaps"]
    }
    if at_branch:
        lines.append(
            f"at step {branch_at} each branch first evaluated its trunk's state under its own "
            "config (the same weights, before any step under it), against base: " +
            ", ".join(f"{n} {g:+.3%}" for n, g in at_branch.items()))
    seen = read_share(runs[0])
    if seen is not None:
        lines.append(
            f"corpus: {runs[0]['corpus_tokens']:,} tokens ({runs[0]['corpus_bytes']:,} bytes);"
            f" {runs[0]['final_step']} steps of {runs[0]['tokens_per_step']:,} tokens read "
            f"{seen:.2f} of it" + ("" if seen <= 1 else " (more than once: the runs repeat "
                                   "examples; a larger --data compares the formats better)"))
    worst, got, seeds = result["max_abs_gap_fp8"], result["max_abs_gap_checked"], result["seeds"]
    what = (f"fp8 against base over {seeds['seeds']} seeds each: largest |gap of the mean "
            "held-out losses|" if seeds else "fp8 against base: largest |gap|")
    after = f"after step {branch_at}"
    if got is None:
        lines.append(f"{what}: no eval {after} (FAIL)")
    else:
        alone = ""
        if seeds:
            at = max(result["checked_steps"], key=lambda s: abs(seeds["steps"][s]["gap_of_means"]))
            v = seeds["steps"][at]
            alone = (f"; at step {at} its standard error is {v['gap_se']:.2%} unpaired, "
                     f"{v['paired_gap_se']:.2%} paired; the seed-0 pair alone {worst:.3%}")
        lines.append(f"{what} {after} {got:.3%} (<= {max_gap:.2%} at every eval: "
                     f"{'PASS' if result['pass'] else 'FAIL'}){alone}")
    if result["noise_floor"] is not None:
        lines.append(f"noise floor: the controls' largest |gap| {after} "
                     f"{result['noise_floor']:.3%} (bf16 against bf16 rounded otherwise)")
    if result["noise_floor_train"] is not None:
        fp8_train = max(abs(g) for g in result["train_window_gaps"]["fp8"].values())
        lines.append(f"train cross-entropy means: fp8's largest |gap| {fp8_train:.3%}, the "
                     f"controls' {result['noise_floor_train']:.3%}")
    return lines


def record(head: dict, runs: list[dict], result: dict, max_gap: float) -> dict:
    """The results JSON of a compared set of runs (head: what, machine, date, commit, ...)."""
    return {
        **head,
        "runs": runs,
        "steps": result["steps"],
        "relative_gaps": result["gaps"],
        "gap_references": result["gap_references"],
        "max_abs_gap_fp8": result["max_abs_gap_fp8"],
        "seeds": result["seeds"],
        "checked_steps": result["checked_steps"],
        "max_abs_gap_checked": result["max_abs_gap_checked"],
        "noise_floor": result["noise_floor"],
        "train_windows": result["train_windows"],
        "train_window_gaps": result["train_window_gaps"],
        "router_entropy_windows": result["router_entropy_windows"],
        "noise_floor_train": result["noise_floor_train"],
        "max_gap": max_gap,
        "pass": result["pass"],
        "corpus_read": read_share(runs[0]),  # the share of the corpus the base run's steps read
    }


def recorded_runs(path: str) -> tuple[dict, list[dict]]:
    """(head, runs) of a results JSON, complete or cut short (its finished runs), with the
    step keys JSON made strings back to ints."""
    got = json.loads(Path(path).read_text())
    if not isinstance(got, dict) or not got.get("runs"):
        raise SystemExit(f"{path}: no recorded runs (a benchmarks.fp8_quality JSON has 'runs')")
    head = {k: v for k, v in got.items() if k in HEAD}
    return head, [int_steps(r) for r in got["runs"]]


def paired(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """The runs that compare: base and fp8 at the seeds where both finished (a set cut short
    may hold one without the other), and the other runs whose seed's base is among them; and
    the names of the runs left out."""
    seeds = {g: {seed_of(r) for r in runs if r.get("group") == g} for g in ("base", "fp8")}
    both = seeds["base"] & seeds["fp8"]
    kept = [r for r in runs if seed_of(r) in both]  # the others' reference is their seed's base
    return kept, [r["name"] for r in runs if r not in kept]
