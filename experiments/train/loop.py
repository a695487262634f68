"""The training loop: ``Trainer(prepared, job_log_dir).run()``.

- initialises (or restores, from the newest orbax checkpoint in ``job_log_dir/checkpoints``
  that restores: ``experiments.train.checkpoints``) the state with explicit shardings
  (``experiments.train.steps``);
- runs the jitted train steps, every ``eval_every`` steps the held-out loss and perplexity;
- writes ``metrics.jsonl`` and TensorBoard events (per MoE layer l, ``max_mean_load_layer_l``:
  max / mean of its expert load, and ``router_entropy_layer_l``), checkpoints every
  ``checkpoint_every`` steps, at the end and on SIGTERM/SIGINT once training has begun
  (``experiments.train.signals``: before that, or at a second signal, the process ends at
  once), and draws ``summary.png`` (loss curves and the expert-load heatmap, layers x
  experts) when it finishes (``experiments.train.metrics``);
- stops without saving at a step whose loss or gradient norm is not finite
  (``train.on_nonfinite='stop'``), or counts it as skipped and stops after more than
  ``train.max_skipped_steps`` of them in a row (``'skip'``; the step left the state as it was).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from experiments import data as data_lib
from experiments.train.checkpoints import Checkpoints, NonFiniteState
from experiments.train.metrics import MetricsWriter, layer_scalars, plot_summary
from experiments.data.pipeline import bits_per_byte, train_batches
from experiments.train.setup import Prepared
from experiments.train.signals import StopSignals
from experiments.train.steps import make_step_fns, put_batch


class Trainer:
    """Runs one prepared experiment in ``job_log_dir`` (resuming from its checkpoints).

    signals: the job's installed ``StopSignals`` (``experiments.main`` installs them first
      thing); None = ``run`` installs its own for its duration."""

    def __init__(self,
                 prep: Prepared,
                 job_log_dir,
                 *,
                 progress: bool = True,
                 signals: StopSignals | None = None):
        self.prep = prep
        self.exp = prep.config
        self.job_log_dir = Path(job_log_dir).absolute()
        self.is_chief = jax.process_index() == 0
        self.progress = progress and self.is_chief
        self.fns = make_step_fns(prep)
        self.dataset = prep.dataset or data_lib.load_dataset(self.exp.data)
        self.signals = signals
        self.ckpt_dir = self.job_log_dir / "checkpoints"
        self.checkpoints = Checkpoints(self.ckpt_dir, self.exp.train.max_checkpoints,
                                       self.fns.abstract_state)
        self.png_path = self.job_log_dir / "summary.png"

    def _say(self, line: str, err: bool = False):
        if self.is_chief:
            print(line, file=sys.stderr if err else sys.stdout, flush=True)

    def _restore(self, mngr, set_aside: bool):
        """(state or None, step or None) of the newest checkpoint that restores; says which
        newer ones it passed over and why."""
        state, step, notes = self.checkpoints.restore_newest(mngr, set_aside=set_aside)
        for note in notes:
            self._say(note, err=True)
        return state, step

    def _diverged(self, mngr, step: int, what: str) -> str:
        """The one-line message of a run stopped by a non-finite value at ``step``."""
        mngr.wait_until_finished()
        latest = mngr.latest_step()
        kept = "no checkpoint was written" if latest is None else \
            f"the newest checkpoint is step {latest} in {self.ckpt_dir}"
        return f"step {step}: {what}; stopped without saving this state; {kept}"

    def _save(self, mngr, state, step: int, result: dict) -> bool:
        """Saves a checkpoint; False (and ``result['diverged']`` set) if the state is not
        finite, which a finite loss and gradient norm do not rule out (an overflowing update)."""
        try:
            self.checkpoints.save(mngr, state, step)
        except NonFiniteState as e:
            result["diverged"] = self._diverged(mngr, step, str(e))
            return False
        return True

    def _eval_batches(self) -> list[tuple[dict, dict]]:
        """(host batch, device batch) of each held-out batch."""
        return [(b, put_batch(b, self.fns.batch_sharding))
                for b in self.dataset.eval_batches(self.exp.train.eval_batches)]

    def _evaluate(self, state, eval_batches) -> dict:
        xs = [float(self.fns.eval(state, b)["xent"]) for _, b in eval_batches]
        loss = float(np.mean(xs))
        return {
            "heldout_loss": loss,
            "heldout_perplexity": math.exp(min(loss, 700.0)),
            "heldout_bits_per_byte": bits_per_byte(xs, [h for h, _ in eval_batches])
        }

    def evaluate_latest(self) -> dict:
        """Held-out loss and perplexity of the newest checkpoint that restores (``--mode=eval``).
        Writes nothing in the job directory."""
        mngr = self.checkpoints.manager(create=False)
        try:
            with jax.set_mesh(self.prep.mesh):
                state, step = self._restore(mngr, set_aside=False)
                if state is None:
                    raise FileNotFoundError(f"--mode=eval needs a checkpoint; {self.ckpt_dir} has "
                                            "none (train first, or point --job_log_dir at a run)")
                result = {"step": step, **self._evaluate(state, self._eval_batches())}
        finally:
            mngr.close()
        return result

    def run(self) -> dict:
        """Trains to ``train.num_steps`` (or until SIGTERM/SIGINT, or a non-finite value).
        Returns a summary dict: start_step, final_step, stopped_by (None or the signal name),
        diverged (None or the one-line message of a non-finite stop), skipped_steps, last train
        and eval metrics, and the paths written."""
        exp, tr = self.exp, self.exp.train
        writer = MetricsWriter(self.job_log_dir, self.is_chief)
        mngr = self.checkpoints.manager()
        signals = self.signals or StopSignals().install()
        result = {
            "job_log_dir": str(self.job_log_dir),
            "metrics": str(writer.path),
            "tensorboard": str(writer.tb_dir),
            "checkpoints": str(self.ckpt_dir),
            "plot": str(self.png_path),
            "stopped_by": None,
            "diverged": None,
            "skipped_steps": 0,
            "last_eval": None
        }
        try:
            with jax.set_mesh(self.prep.mesh):
                state, restored = self._restore(mngr, set_aside=True)
                if state is None:
                    state = self.fns.init(jax.random.key(tr.seed))
                else:
                    self._say(f"resumed from the checkpoint of step {restored}")
                start = int(jax.device_get(state["step"]))
                result["start_step"] = start
                result["restored_from"] = restored
                eval_batches = self._eval_batches()
                if start == 0 or (tr.eval_on_restore and start < tr.num_steps):
                    ev = self._evaluate(state, eval_batches)
                    writer.write("eval", start, ev)
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
                in_a_row = 0  # steps skipped in a row (train.on_nonfinite='skip')
                feed = train_batches(self.dataset, start, tr.num_steps, self.fns.batch_sharding)
                signals.training()  # from here a signal stops after the step and saves
                while step < tr.num_steps and signals.stop_requested is None:
                    # tokens/s of the step alone: from its batch to its metrics on the host,
                    # not the eval, checkpoint or logging that follow some steps
                    t_step = time.perf_counter()
                    batch = next(feed)
                    state, metrics = train_step(state, batch)
                    metrics = jax.device_get(metrics)
                    step += 1
                    tps = tokens / max(time.perf_counter() - t_step, 1e-9)
                    load = metrics.pop("expert_load", None)
                    balance = metrics.pop("max_mean_load", None)
                    entropy = metrics.pop("router_entropy_by_layer", None)
                    last = {k: float(v) for k, v in metrics.items()}
                    if balance is not None:
                        last.update(layer_scalars("max_mean_load", balance))
                    if entropy is not None:
                        last.update(layer_scalars("router_entropy", entropy))
                    last["tokens_per_sec"] = tps
                    writer.write("train", step, last)
                    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(last[k])]
                    in_a_row = in_a_row + 1 if bad else 0
                    if bad and tr.on_nonfinite == "skip":
                        result["skipped_steps"] += 1
                    if bad and (tr.on_nonfinite == "stop" or in_a_row > tr.max_skipped_steps):
                        values = f"loss {last['loss']:.4g}, grad_norm {last['grad_norm']:.4g}"
                        verb = "is" if len(bad) == 1 else "are"
                        what = (f"{' and '.join(bad)} {verb} not finite ({values}; train."
                                "on_nonfinite='stop')" if tr.on_nonfinite == "stop" else
                                f"{in_a_row} steps in a row skipped, more than train."
                                f"max_skipped_steps={tr.max_skipped_steps} ({values})")
                        result["diverged"] = self._diverged(mngr, step, what)
                        break
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
                        if not self._save(mngr, state, step, result):
                            break
                    if tr.sigterm_at_step and step == tr.sigterm_at_step:
                        os.kill(os.getpid(), signal.SIGTERM)
                if bar is not None:
                    bar.close()
                if result["diverged"] is None:
                    self._save(mngr, state, step, result)
                mngr.wait_until_finished()
                result["final_step"] = step
                result["last_train"] = last
                result["stopped_by"] = signals.stop_requested
        finally:
            if self.signals is None:
                signals.uninstall()
            mngr.close()
            writer.close()
        if self.is_chief and result["stopped_by"] is None and result["diverged"] is None and \
                writer.path.exists():
            plot_summary(writer.path, self.png_path, title=exp.name)
        return result
