"""Decode throughput of ``experiments.sample.decoding.Sampler``: `python -m benchmarks.bench_sample`.

Builds an experiment's model (default ``small_gpu``) with initialised parameters on the job's
mesh (decoding arithmetic does not depend on the values), made dropless as
``experiments.sample.load_sampler`` makes it, and for each batch size (``--batches``, default
1,32) samples ``--new-tokens`` tokens after prompts of ``--prompt-len`` random bytes with the KV
cache, greedy: one untimed call compiles, then ``--reps`` timed calls. Prints a table (prefill
ms, decode tokens/s over all rows, ms per decode step; medians over the reps) and writes JSON
(``--out``, default benchmarks/results/sample_bench.json).
Options: --exp small_gpu --batches 1,32 --prompt-len 128 --new-tokens 256 --reps 3 --out PATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import jax
import numpy as np

from configs import registry
from experiments import sample
from experiments.train import setup
from experiments.sample.decoding import Sampler
from experiments.train.steps import make_step_fns
from praxis import base_layer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exp", default="small_gpu", help="registered experiment (snake_case)")
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/sample_bench.json")
    return p


def make_sampler(exp_name: str) -> Sampler:
    """A Sampler over initialised parameters of the registered experiment ``exp_name``."""
    cfg = registry.get_experiment(exp_name)().experiment_config()
    cfg.model = sample.decode_config(cfg.model)
    prep = setup.prepare(cfg, load_data=False)
    fns = make_step_fns(prep)
    with jax.set_mesh(prep.mesh):
        state = fns.init(jax.random.key(0))
    variables = {base_layer.PARAMS: state["params"], **state["non_trainable"]}
    return Sampler(prep, variables, sample.PromptTokenizer(prep.tokenizer, False), step=0)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sampler = make_sampler(args.exp)
    rng = np.random.default_rng(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [list(rng.integers(32, 127, size=args.prompt_len)) for _ in range(b)]
        run = lambda: sampler.sample(prompts, max_new_tokens=args.new_tokens)
        first = run()  # compiles
        outs = [run() for _ in range(args.reps)]
        assert all(o.dropped == 0 for o in outs + [first])
        rows.append({
            "batch":
            b,
            "prompt_len":
            args.prompt_len,
            "new_tokens":
            args.new_tokens,
            "prefill_ms":
            1e3 * statistics.median(o.prefill_seconds for o in outs),
            "decode_tokens_per_s":
            statistics.median(o.decode_tokens_per_second for o in outs),
            "ms_per_step":
            statistics.median(o.ms_per_token for o in outs),
            "compile_s":
            first.compile_seconds,
        })
    print(f"{args.exp} on {jax.device_count()} x {jax.devices()[0].device_kind}; prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new, greedy, median of {args.reps}")
    print(f"{'batch':>6} {'prefill ms':>11} {'decode tok/s':>13} {'ms/step':>8} "
          f"{'compile s':>10}")
    for r in rows:
        print(f"{r['batch']:>6} {r['prefill_ms']:>11.2f} {r['decode_tokens_per_s']:>13,.1f} "
              f"{r['ms_per_step']:>8.3f} {r['compile_s']:>10.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_sample",
                "exp": args.exp,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "host": platform.node(),
                "devices": [str(d) for d in jax.devices()],
                "jax": jax.__version__,
                "rows": rows,
            },
            indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
