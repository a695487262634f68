"""The training loop: ``Trainer(prepared, job_log_dir).run()``.

- initialises (or restores, from the latest orbax checkpoint in ``job_log_dir/checkpoints``)
  the state with explicit shardings (``experiments.steps``);
- runs the jitted train steps, every ``eval_every`` steps the held-out loss and perplexity;
- writes ``metrics.jsonl`` and TensorBoard events, checkpoints every ``checkpoint_every``
  steps, at the end and on SIGTERM/SIGINT, and draws ``summary.png`` (loss curves and the
  expert-load heatmap, layers x experts) when it finishes (``experiments.metrics``).
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np

from experiments import data as data_lib
from experiments.checkpoints import Checkpoints
from experiments.metrics import MetricsWriter, plot_summary
from experiments.setup import Prepared
from experiments.steps import make_step_fns, put_batch


class Trainer:
    """Runs one prepared experiment in ``job_log_dir`` (resuming from its checkpoints)."""

    def __init__(self, prep: Prepared, job_log_dir, *, progress: bool = True):
        self.prep = prep
        self.exp = prep.config
        self.job_log_dir = Path(job_log_dir).absolute()
        self.is_chief = jax.process_index() == 0
        self.progress = progress and self.is_chief
        self.fns = make_step_fns(prep)
        self.dataset = prep.dataset or data_lib.load_dataset(self.exp.data)
        self._stop_signal = None
        self.ckpt_dir = self.job_log_dir / "checkpoints"
        self.checkpoints = Checkpoints(self.ckpt_dir, self.exp.train.max_checkpoints,
                                       self.fns.abstract_state)
        self.png_path = self.job_log_dir / "summary.png"

    # -- signals
    def _on_signal(self, signum, frame):
        self._stop_signal = signum

    def _evaluate(self, state, eval_batches) -> dict:
        xs = [float(self.fns.eval(state, b)["xent"]) for b in eval_batches]
        loss = float(np.mean(xs))
        return {"heldout_loss": loss, "heldout_perplexity": math.exp(min(loss, 700.0))}

    def evaluate_latest(self) -> dict:
        """Held-out loss and perplexity of the latest checkpoint (``--mode=eval``)."""
        mngr = self.checkpoints.manager()
        try:
            step = mngr.latest_step()
            if step is None:
                raise FileNotFoundError(f"--mode=eval needs a checkpoint; {self.ckpt_dir} has "
                                        "none (train first, or point --job_log_dir at a run)")
            with jax.set_mesh(self.prep.mesh):
                state = self.checkpoints.restore(mngr, step)
                batches = [
                    put_batch(b, self.fns.batch_sharding)
                    for b in self.dataset.eval_batches(self.exp.train.eval_batches)
                ]
                result = {"step": step, **self._evaluate(state, batches)}
        finally:
            mngr.close()
        return result

    def run(self) -> dict:
        """Trains to ``train.num_steps`` (or until SIGTERM/SIGINT). Returns a summary dict:
        start_step, final_step, stopped_by (None or the signal name), last train and eval
        metrics, and the paths written."""
        exp, tr = self.exp, self.exp.train
        writer = MetricsWriter(self.job_log_dir, self.is_chief)
        mngr = self.checkpoints.manager()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        result = {
            "job_log_dir": str(self.job_log_dir),
            "metrics": str(writer.path),
            "tensorboard": str(writer.tb_dir),
            "checkpoints": str(self.ckpt_dir),
            "plot": str(self.png_path),
            "stopped_by": None,
            "last_eval": None
        }
        try:
            with jax.set_mesh(self.prep.mesh):
                state, restored = self.checkpoints.restore_or_init(
                    mngr, lambda: self.fns.init(jax.random.key(tr.seed)))
                start = int(jax.device_get(state["step"]))
                result["start_step"] = start
                result["restored_from"] = restored
                eval_batches = [
                    put_batch(b, self.fns.batch_sharding)
                    for b in self.dataset.eval_batches(tr.eval_batches)
                ]
                if start == 0:
                    ev = self._evaluate(state, eval_batches)
                    writer.write("eval", 0, ev)
                    result["first_eval"] = ev
                tokens = exp.data.batch_size * exp.data.seq_len
                train_step = self.fns.train
                if start < tr.num_steps:  # compile ahead, so tokens/s is the step's own
                    t0 = time.perf_counter()
                    train_step = self.fns.train.lower(
                        state, put_batch(self.dataset.train_batch(start),
                                         self.fns.batch_sharding)).compile()
                    result["compile_seconds"] = time.perf_counter() - t0
                bar = None
                if self.progress and start < tr.num_steps:
                    from tqdm import tqdm

                    bar = tqdm(total=tr.num_steps,
                               initial=start,
                               desc=exp.name,
                               unit="step",
                               dynamic_ncols=True)
                step = start
                last = {}
                t_prev = time.perf_counter()
                while step < tr.num_steps and self._stop_signal is None:
                    batch = put_batch(self.dataset.train_batch(step), self.fns.batch_sharding)
                    state, metrics = train_step(state, batch)
                    metrics = jax.device_get(metrics)
                    step += 1
                    now = time.perf_counter()
                    tps = tokens / max(now - t_prev, 1e-9)
                    t_prev = now
                    load = metrics.pop("expert_load", None)
                    last = {k: float(v) for k, v in metrics.items()}
                    last["tokens_per_sec"] = tps
                    writer.write("train", step, last)
                    if load is not None and (step % tr.summary_every == 0 or step == tr.num_steps):
                        writer.write("expert_load", step, {"load": np.asarray(load)})
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tps:,.0f}")
                    if step % tr.eval_every == 0 or step == tr.num_steps:
                        ev = self._evaluate(state, eval_batches)
                        writer.write("eval", step, ev)
                        result["last_eval"] = ev
                        if bar is not None:
                            bar.write(f"step {step}: held-out loss {ev['heldout_loss']:.4f}, "
                                      f"perplexity {ev['heldout_perplexity']:.3f}")
                    if tr.checkpoint_every and step % tr.checkpoint_every == 0:
                        self.checkpoints.save(mngr, state, step)
                    if tr.sigterm_at_step and step == tr.sigterm_at_step:
                        os.kill(os.getpid(), signal.SIGTERM)
                if bar is not None:
                    bar.close()
                self.checkpoints.save(mngr, state, step)
                mngr.wait_until_finished()
                result["final_step"] = step
                result["last_train"] = last
                if self._stop_signal is not None:
                    result["stopped_by"] = signal.Signals(self._stop_signal).name
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            mngr.close()
            writer.close()
        if self.is_chief and result["stopped_by"] is None and writer.path.exists():
            plot_summary(writer.path, self.png_path, title=exp.name)
        return result
