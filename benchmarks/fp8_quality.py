"""FP8 training quality: TinyBf16 and TinyFp8 (the same seed, data and steps; the expert GEMMs
in bf16 or in blockwise FP8) trained by the experiment main, held-out losses compared.

    python -m benchmarks.fp8_quality [--steps N] [--out benchmarks/results/fp8_quality.json]
                                     [--base configs.experiments.TinyBf16]
                                     [--fp8 configs.experiments.TinyFp8] [--max_gap 0.01]

The check: the final held-out loss of the FP8 run within 1% (relative) of the bf16 run.
Each run is a fresh `python -m experiments.main` in its own job directory (a temporary one
unless --keep DIR). Prints the held-out loss at every evaluation, the relative gap, PASS/FAIL;
writes the JSON. On a CPU the FP8 run uses the pure-JAX emulation of the FP8 GEMMs (the same
arithmetic as the kernels, up to summation order).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def train(exp: str, job_dir: Path, steps: int | None) -> dict:
    cmd = [
        sys.executable, "-m", "experiments.main", f"--exp={exp}", f"--job_log_dir={job_dir}",
        "--no_progress"
    ]
    if steps:
        cmd.append(f"--fdl.train.num_steps={steps}")
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{exp} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    evals = [r for r in read_metrics(job_dir / "metrics.jsonl") if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{exp}: no eval records in {job_dir / 'metrics.jsonl'}")
    return {
        "exp": exp,
        "seconds": round(time.time() - t0, 1),
        "heldout_loss": {
            r["step"]: r["heldout_loss"]
            for r in evals
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="configs.experiments.TinyBf16")
    ap.add_argument("--fp8", default="configs.experiments.TinyFp8")
    ap.add_argument("--steps",
                    type=int,
                    default=None,
                    help="train.num_steps (default: the "
                    "experiment's)")
    ap.add_argument("--max_gap", type=float, default=0.01, help="relative held-out loss gap")
    ap.add_argument("--keep", default=None, help="job directories under this folder")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_quality.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(args.keep or tmp)
        runs = [
            train(exp, top / exp.rsplit(".", 1)[-1], args.steps) for exp in (args.base, args.fp8)
        ]
    base, fp8 = (r["heldout_loss"] for r in runs)
    steps = sorted(set(base) & set(fp8))
    print(f"| step | {args.base} | {args.fp8} | gap (relative) |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s} | {base[s]:.4f} | {fp8[s]:.4f} | {(fp8[s] - base[s]) / base[s]:+.4%} |")
    last = steps[-1]
    gap = (fp8[last] - base[last]) / base[last]
    ok = abs(gap) <= args.max_gap
    print(f"final step {last}: gap {gap:+.4%} (|gap| <= {args.max_gap:.2%}: "
          f"{'PASS' if ok else 'FAIL'}); {runs[0]['seconds']} s / {runs[1]['seconds']} s")
    out = {
        "what": "held-out loss, bf16 vs blockwise FP8 expert GEMMs, same seed/data/steps",
        "machine": platform.node(),
        "python": platform.python_version(),
        "runs": runs,
        "final_step": last,
        "relative_gap": gap,
        "max_gap": args.max_gap,
        "pass": ok,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
