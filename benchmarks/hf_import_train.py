r"""Import a Qwen3-30B-A3B-shaped checkpoint and train it: ``python -m benchmarks.hf_import_train``.

Writes a random model with Qwen3-30B-A3B's layer shapes (M=2048, 32 query heads and 4 key/value
heads of 128, q/k RMSNorm per head, 128 experts of H=768, top-8 renormalised, vocabulary 151936,
untied embeddings) and ``--layers`` (default 4) of its 48 layers in the Hugging Face layout:
config.json, bfloat16 safetensors shards (one per layer, the embeddings in their own) with
model.safetensors.index.json, and a small tokenizer.json. numpy and safetensors only: nothing
is downloaded and transformers is not needed. Then imports it with ``experiments.import_hf``
(timed; the job directory's size and the host's peak resident memory are printed, also by
stage: writing the folder, then each stage the import logs), restores the
imported step 0 as training does, and runs ``--steps`` train steps of ``--batch`` x ``--seq``
random tokens, printing tokens/s (median step after the first, which compiles) and the device's
peak memory. No checkpoint is written after the import (disk: the checkpoint of a 4-layer
model's float32 parameters and Adam moments is about 36 GB).

Options: --work DIR (default /tmp/hf_qwen3_4l) --layers 4 --steps 20 --batch 8 --seq 2048
--dtype bfloat16 --tiny (small widths: checks the script on a CPU in seconds)
--pinned_host import|auto|on|off (the import's checkpoint copied to the host through pinned
memory: import, the default, as experiments.import_hf does (SAVE_PINNED_HOST, off); auto: orbax's
default, on for GPUs)
--out benchmarks/results/hf_import_train.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import resource
import shutil
import statistics
import threading
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments import import_hf
from experiments.job import jobdir
from experiments.train import setup, steps
from experiments.train.checkpoints import Checkpoints
from experiments.hf.checkpoint import read_config

QWEN3_30B_A3B = dict(vocab_size=151936,
                     hidden_size=2048,
                     num_hidden_layers=48,
                     num_attention_heads=32,
                     num_key_value_heads=4,
                     head_dim=128,
                     moe_intermediate_size=768,
                     intermediate_size=6144,
                     num_experts=128,
                     num_experts_per_tok=8,
                     norm_topk_prob=True,
                     rope_theta=1e6,
                     rms_norm_eps=1e-6,
                     tie_word_embeddings=False,
                     router_aux_loss_coef=0.001,
                     decoder_sparse_step=1,
                     mlp_only_layers=[],
                     use_sliding_window=False,
                     sliding_window=None,
                     attention_bias=False,
                     attention_dropout=0.0,
                     hidden_act="silu",
                     max_position_embeddings=40960,
                     model_type="qwen3_moe",
                     architectures=["Qwen3MoeForCausalLM"],
                     torch_dtype="bfloat16")
# --tiny: the same layout at widths a CPU runs in seconds (a check of the script, not a timing)
TINY = dict(vocab_size=512,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2)

PINNED_HOST = {"import": import_hf.SAVE_PINNED_HOST, "auto": None, "on": True, "off": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/hf_qwen3_4l")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--tiny", action="store_true", help="small widths, for a CPU check")
    p.add_argument("--pinned_host",
                   default="import",
                   choices=tuple(PINNED_HOST),
                   help="the import's checkpoint copied to the host through pinned memory: "
                   "'import' (experiments.import_hf's default: off), 'auto' (orbax's default, "
                   "on for GPUs), 'on' or 'off'")
    p.add_argument("--out", default="benchmarks/results/hf_import_train.json")
    return p


def layer_tensors(cfg: dict, l: int, rng) -> dict:
    """Layer ``l``'s tensors as Qwen3-MoE names and lays them out, bfloat16, std 0.02."""
    m, n, k, d = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                  cfg["head_dim"])
    e, h = cfg["num_experts"], cfg["moe_intermediate_size"]
    bf16 = ml_dtypes.bfloat16

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(bf16)

    p = f"model.layers.{l}"
    out = {
        f"{p}.input_layernorm.weight": np.ones(m, bf16),
        f"{p}.post_attention_layernorm.weight": np.ones(m, bf16),
        f"{p}.self_attn.q_proj.weight": w(n * d, m),
        f"{p}.self_attn.k_proj.weight": w(k * d, m),
        f"{p}.self_attn.v_proj.weight": w(k * d, m),
        f"{p}.self_attn.o_proj.weight": w(m, n * d),
        f"{p}.self_attn.q_norm.weight": np.ones(d, bf16),
        f"{p}.self_attn.k_norm.weight": np.ones(d, bf16),
        f"{p}.mlp.gate.weight": w(e, m),
    }
    for i in range(e):
        out[f"{p}.mlp.experts.{i}.gate_proj.weight"] = w(h, m)
        out[f"{p}.mlp.experts.{i}.up_proj.weight"] = w(h, m)
        out[f"{p}.mlp.experts.{i}.down_proj.weight"] = w(m, h)
    return out


def write_model(model_dir: Path, layers: int, tiny: bool = False) -> dict:
    """The Hugging Face folder of a random ``layers``-layer Qwen3-30B-A3B-shaped model (its
    widths, or TINY's)."""
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=layers, **(TINY if tiny else {}))
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(0)
    v, m = cfg["vocab_size"], cfg["hidden_size"]
    bf16 = ml_dtypes.bfloat16
    files = [("model-embed.safetensors", {
        "model.embed_tokens.weight": (rng.standard_normal((v, m), np.float32) * 0.02).astype(bf16),
        "lm_head.weight": (rng.standard_normal((v, m), np.float32) * 0.02).astype(bf16),
        "model.norm.weight":
        np.ones(m, bf16)
    })]
    weight_map = {}
    for name, tensors in files:
        save_file(tensors, str(model_dir / name))
        weight_map.update({t: name for t in tensors})
    for l in range(layers):
        name = f"model-layer{l:02d}.safetensors"
        tensors = layer_tensors(cfg, l, rng)
        save_file(tensors, str(model_dir / name))
        weight_map.update({t: name for t in tensors})
        del tensors
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({
            "metadata": {},
            "weight_map": weight_map
        }, indent=1))
    text = ["The mixture of experts routes each token to eight of its 128 experts."] * 64
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(vocab_size=400,
                            special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False))
    tok.save(str(model_dir / "tokenizer.json"))
    texts = model_dir.parent / "texts"
    texts.mkdir(exist_ok=True)
    (texts / "a.txt").write_text("\n".join(text * 4))
    return cfg


class HostMemoryByStage(logging.Handler):
    """The process's peak resident memory (GiB, /proc/self/statm sampled every 50 ms) in each
    stage: 'write' (the HF folder), then each stage the import logs as it starts
    ("import: <stage>", experiments.import_hf)."""

    def __init__(self):
        super().__init__()
        self.stage, self.peaks = "write", {}
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("import: "):
            self._note()
            self.stage = msg[len("import: "):]

    def _note(self):
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * self._page / 2**30
        self.peaks[self.stage] = max(self.peaks.get(self.stage, 0.0), rss)

    def _sample(self):
        while not self._stop.wait(0.05):
            self._note()

    def __enter__(self):
        logging.getLogger("absl").addHandler(self)
        logging.getLogger("absl").setLevel(logging.INFO)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._note()
        logging.getLogger("absl").removeHandler(self)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    model_dir, job = work / "model", work / "job"
    with HostMemoryByStage() as host:
        t0 = time.perf_counter()
        write_model(model_dir, args.layers, args.tiny)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        import_hf.import_checkpoint(model_dir,
                                    job,
                                    data_path=work / "texts",
                                    seq_len=args.seq,
                                    batch_size=args.batch,
                                    dtype=args.dtype,
                                    repeat=True,
                                    remat=True,
                                    progress=True,
                                    pinned_host=PINNED_HOST[args.pinned_host])
        t_import = time.perf_counter() - t0
    host_peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    orbax_version = importlib.metadata.version("orbax-checkpoint")
    print(
        f"wrote the HF folder ({_du(model_dir) / 1e9:.1f} GB) in {t_write:.0f} s; imported in "
        f"{t_import:.0f} s (job directory {_du(job) / 1e9:.1f} GB, host peak RSS "
        f"{host_peak_gb:.1f} GiB)",
        flush=True)
    print("host peak by stage (GiB): " + ", ".join(f"{k} {v:.1f}" for k, v in host.peaks.items()) +
          f" (pinned_host {args.pinned_host}, orbax-checkpoint {orbax_version})",
          flush=True)

    cfg = jobdir.load_recorded(job)
    setup.resolve_lengths(cfg)
    prep = setup.prepare(cfg, job_log_dir=job, load_data=False)
    fns = steps.make_step_fns(prep)
    ckpts = Checkpoints(job / "checkpoints", 1, fns.abstract_state)
    mngr = ckpts.manager(create=False)
    with jax.set_mesh(prep.mesh):
        state, step, _ = ckpts.restore_newest(mngr, set_aside=False)
    mngr.close()
    rng = np.random.default_rng(0)
    vocab = prep.tokenizer.vocab_size
    times, losses = [], []
    with jax.set_mesh(prep.mesh):
        for _ in range(args.steps):
            ids = rng.integers(0, vocab, (args.batch, args.seq + 1), dtype=np.int32)
            batch = steps.put_batch(
                {
                    "ids": ids[:, :-1],
                    "labels": ids[:, 1:],
                    "weights": np.ones((args.batch, args.seq), np.float32)
                }, fns.batch_sharding)
            t0 = time.perf_counter()
            state, metrics = fns.train(state, batch)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", 0) / 2**30
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    tokens = args.batch * args.seq
    row = {
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "steps": args.steps,
        "compile_and_first_step_s": times[0],
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_device_memory_gib": peak,
        "host_peak_rss_gib": host_peak_gb,
        "host_peak_by_stage_gib": host.peaks,
        "pinned_host": args.pinned_host,
        "pinned_host_transfer": PINNED_HOST[args.pinned_host],  # None: orbax's default
        "import_s": t_import,
        "hf_folder_gb": _du(model_dir) / 1e9,
        "job_dir_gb": _du(job) / 1e9,
        "losses": losses,
        "num_params": read_config(model_dir).num_params,
    }
    print(f"{args.layers} layers of Qwen3-30B-A3B ({row['num_params'] / 1e9:.2f} B params), "
          f"{args.batch} x {args.seq} tokens a step, {args.dtype}: {row['tokens_per_s']:,.0f} "
          f"tokens/s (median step {1e3 * step_s:.0f} ms; first step with compile "
          f"{times[0]:.0f} s), peak device memory {peak:.1f} GiB; loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")
    record = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__,
            "orbax_checkpoint": orbax_version,
            "python": platform.python_version()
        },
        "result": row
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
