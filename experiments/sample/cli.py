"""``python -m experiments.main --mode=sample``: the flags and the report of ``experiments.sample``.

  python -m experiments.main --mode=sample --job_log_dir=runs/tiny --prompt="def main(" \\
      --max_new_tokens=48 --temperature=0.8 --top_p=0.95 --num_samples=2

Prints each prompt with its continuations, then the prefill time, decode tokens/s and ms per
token; ``--output_json=F`` writes them with the token ids and log-probabilities. Nothing else is
written (the job directory is only read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from experiments import sample
from experiments.job.errors import SampleError


def _define(define, name: str, default, help_: str):
    """A flag of --mode=sample (its help says so)."""
    return define(name, default, f"--mode=sample: {help_}")


_PROMPT = _define(flags.DEFINE_multi_string, "prompt", [],
                  "a prompt to continue (repeatable; with --prompts_file, these come first).")
_PROMPTS_FILE = _define(flags.DEFINE_string, "prompts_file", None,
                        "a UTF-8 text file of prompts, one per line (empty lines are an error).")
_MAX_NEW_TOKENS = _define(
    flags.DEFINE_integer, "max_new_tokens", None,
    "tokens generated per continuation; default: as many as fit, the model's context "
    "(data.seq_len) minus the longest prompt's tokens.")
_TEMPERATURE = _define(flags.DEFINE_float, "temperature", 0.0, "softmax temperature; 0 = greedy.")
_TOP_K = _define(flags.DEFINE_integer, "top_k", 0,
                 "draw from the k most likely tokens only (0 = all).")
_TOP_P = _define(
    flags.DEFINE_float, "top_p", 1.0,
    "nucleus sampling, the most likely tokens up to this much probability mass, "
    "in (0, 1] (1 = all).")
_NUM_SAMPLES = _define(flags.DEFINE_integer, "num_samples", 1, "continuations per prompt.")
_SEED = _define(flags.DEFINE_integer, "seed", 0, "the random seed of the draws.")
_STOP_AT_EOS = _define(
    flags.DEFINE_bool, "stop_at_eos", False,
    "end a continuation at the tokenizer's end-of-sequence token (the job's "
    "tokenizer must have one).")
_OUTPUT_JSON = _define(
    flags.DEFINE_string, "output_json", None,
    "also write the prompts, continuations, token ids, log-probabilities and "
    "timings to this JSON file.")


def _prompts() -> list[str]:
    prompts = list(_PROMPT.value)
    if _PROMPTS_FILE.value:
        path = Path(_PROMPTS_FILE.value)
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--prompts_file={str(path)!r} cannot be read ({type(e).__name__}: "
                              f"{getattr(e, 'strerror', None) or e}); give a UTF-8 text file") \
                from None
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the file
        prompts += lines
    for i, p in enumerate(prompts):
        if not p:
            raise SampleError(f"prompt {i} is empty (--prompt='' or an empty line in "
                              "--prompts_file): give at least one character")
    if not prompts:
        raise SampleError("no prompt given: pass --prompt=TEXT (repeatable) or --prompts_file=F")
    return prompts


def run(job_log_dir, *, progress: bool) -> int:
    """Samples from ``job_log_dir`` as the flags say. Raises experiments.sample.SampleError
    (one line) for a bad flag or job directory."""
    given = [
        f"--{k}" for k in ("exp", "fdl_config", "fdl_config_file", "fdl_set", "fiddler")
        if flags.FLAGS[k].value
    ]
    if given:
        raise sample.SampleError(f"--mode=sample samples the config recorded in --job_log_dir; "
                                 f"drop {', '.join(given)}")
    settings = dict(max_new_tokens=_MAX_NEW_TOKENS.value,
                    temperature=_TEMPERATURE.value,
                    top_k=_TOP_K.value,
                    top_p=_TOP_P.value,
                    num_samples=_NUM_SAMPLES.value)
    sample.check_settings(**settings)
    prompts = _prompts()
    if _OUTPUT_JSON.value and not Path(_OUTPUT_JSON.value).absolute().parent.is_dir():
        raise sample.SampleError(f"--output_json={_OUTPUT_JSON.value!r}: its directory does not "
                                 "exist; create it or give another path")
    got = sample.continuations(job_log_dir,
                               prompts,
                               settings,
                               seed=_SEED.value,
                               stop_at_eos=_STOP_AT_EOS.value,
                               progress=progress)
    out, tok, settings = got.samples, got.tokenizer, got.settings  # max_new_tokens resolved
    n = out.num_samples
    results = []
    for i, p in enumerate(prompts):
        rows = range(i * n, (i + 1) * n)
        texts = got.texts[i]
        print(f"=== prompt {i}: {p!r}")
        for j, text in enumerate(texts):
            print(f"--- sample {j}:\n{p}{text}")
        results.append({
            "prompt":
            p,
            "prompt_ids":
            out.prompts[i * n],
            "samples": [{
                "text": texts[j],
                "token_ids": out.tokens[r],
                "log_probs": out.log_probs[r]
            } for j, r in enumerate(rows)]
        })
    timing = {
        "prefill_seconds": out.prefill_seconds,
        "decode_tokens_per_second": out.decode_tokens_per_second,
        "ms_per_token": out.ms_per_token,
        "compile_seconds": out.compile_seconds,
        "rows": len(out.tokens),
    }
    print(
        f"checkpoint step {got.step}, tokenizer {tok.name}; prefill "
        f"{1e3 * out.prefill_seconds:.1f} ms, decode {out.decode_tokens_per_second:,.1f} "
        f"tokens/s ({out.ms_per_token:.2f} ms per token, {timing['rows']} rows), compile "
        f"{out.compile_seconds:.1f} s",
        flush=True)
    if _OUTPUT_JSON.value:
        path = Path(_OUTPUT_JSON.value)
        record = {
            "job_log_dir": str(job_log_dir),
            "checkpoint_step": got.step,
            "tokenizer": tok.name,
            "settings": {
                **settings, "seed": _SEED.value,
                "stop_at_eos": _STOP_AT_EOS.value
            },
            **timing,
            "results": results,
        }
        try:
            path.write_text(json.dumps(record, indent=1))
        except OSError as e:
            raise sample.SampleError(f"--output_json={str(path)!r} cannot be written "
                                     f"({type(e).__name__}: {e.strerror or e})") from None
        print(f"wrote {path}", flush=True)
    sys.stdout.flush()
    return 0
