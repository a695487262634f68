r"""The main job: train (or evaluate) a registered MoE language-model experiment.

PaxML's flag surface:

  python -m experiments.main                        # the Tiny experiment on this machine
  python -m experiments.main --exp=tiny --job_log_dir=/tmp/tiny --fdl.train.num_steps=50
  python -m experiments.main --exp=configs.experiments.SmallGpu --fdl_set=data.seq_len=512
  python -m experiments.main --fdl_config=tiny_synthetic --fiddler=use_synthetic_data
  python -m experiments.main --mode=eval --job_log_dir=runs/tiny
  python -m experiments.main --mode=sample --job_log_dir=runs/tiny --prompt="def main("
  python -m experiments.main --list_experiments               # the registered experiments
  python -m experiments.main --exp=small_gpu --fdl_help       # its flags and config fields

--exp names a registered experiment (its name, ``module.Class`` or a dotted suffix; case, ``_``
and ``-`` do not count, so ``deepseek_v3`` and ``deep_seek_v3`` are one name);
Fiddle's own flags (``--fdl_config`` a function of ``configs.experiments`` or a dotted
``module.function``, ``--fdl_config_file``, ``--fiddler``, ``--fdl_set=path=value`` and its
alias ``--fdl.path=value``) are defined by ``fiddle.absl_flags`` and applied with its API.
Everything is validated before anything is compiled: a bad name, override path or value stops
with a message that names it and the close matches.

SIGTERM / SIGINT (``experiments.train.signals``, from the first line of ``main``): during start-up the
job ends at once; during training it saves after the step in flight, or ends at a second one.

Multi-host: ``--num_processes --process_id --coordinator_address`` go to
``jax.distributed.initialize`` (CPU processes use gloo collectives).
"""

from __future__ import annotations

import copy
import difflib
import json
import signal
import sys
from pathlib import Path

from absl import app, flags, logging

from fiddle import absl_flags as fdl_flags  # defines --fdl_config, --fdl_set, --fiddler, ...

from experiments.job import errors, info, jobdir
from experiments.sample import cli as sample_cli
from experiments.train import signals
from experiments.job.errors import UsageError
from experiments.job.overrides import apply_fiddlers, apply_overrides
from experiments.tokenizer import job_copy as tokenizer_copy

MODES = ("train", "eval", "sample")
DEFAULT_EXP = "tiny"
EXIT_NONFINITE = 3  # the run stopped at a non-finite loss, gradient norm or state

_EXP = flags.DEFINE_string(
    "exp", None, "Registered experiment: its name (tiny, deepseek_v3; case, _ and - do not count), "
    f"module.Class or a dotted suffix. Default {DEFAULT_EXP!r} without --fdl_config(_file).")
_JOB_LOG_DIR = flags.DEFINE_string(
    "job_log_dir", None, "Where metrics.jsonl, TensorBoard events, checkpoints and the summary "
    "plot go; a run resumes from the newest checkpoint here that restores. Default "
    "./runs/<experiment>.")
_MODE = flags.DEFINE_enum(
    "mode", "train", MODES, "train: train (resuming if possible); "
    "eval: held-out loss of the newest checkpoint that restores; "
    "sample: continue --prompt texts with it (experiments.sample.cli's flags).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "Processes in the job (jax.distributed.initialize num_processes).")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator (needed when "
    "--num_processes > 1).")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Do not draw the tqdm progress bar.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume or evaluate a --job_log_dir whose recorded config "
    "(config.json) differs from this run's; training then records the new config.")
_VERBOSE_ERRORS = flags.DEFINE_bool(
    "verbose_errors", False, "Print the traceback of a config or flag error (exit status 2) "
    "before its one-line message.")
_LIST_EXPERIMENTS = flags.DEFINE_bool(
    "list_experiments", False, "Print the registered experiments (the names --exp takes) and "
    "exit.")

# ------------------------------------------------------------------------ config from flags


def config_from_flags(recorded=None):
    """(experiment config, experiment name) from --exp or Fiddle's --fdl_config flags; with
    neither, from ``recorded`` (a job directory's recorded config) when given, else --exp's
    default."""
    from configs import experiments as exp_module
    from configs import registry

    fv = flags.FLAGS
    fdl_base = fv["fdl_config"].value or fv["fdl_config_file"].value
    if _EXP.value and fdl_base:
        raise UsageError("--exp and --fdl_config/--fdl_config_file are mutually exclusive")
    if fv["fdl_config_file"].value and not fv["fdl_config"].value:
        path = fv["fdl_config_file"].value
        try:
            with _no_fdl_set(fv):
                cfg = fdl_flags.create_buildable_from_flags(exp_module, allow_imports=True)
        except (OSError, ValueError, TypeError, AttributeError, ImportError, KeyError) as e:
            raise UsageError(f"--fdl_config_file={str(path)!r} does not load: "
                             f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}") from e
        name = getattr(cfg, "name", None) or "experiment"
    elif fdl_base:
        names = registry.builtin_config_functions()
        fv["fdl_config"].value = registry.function_name(fv["fdl_config"].value, names)
        try:
            with _no_fdl_set(fv):
                cfg = fdl_flags.create_buildable_from_flags(exp_module, allow_imports=True)
        except (ValueError, AttributeError, ModuleNotFoundError) as e:
            close = difflib.get_close_matches(str(fv["fdl_config"].value), names, n=5, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"--fdl_config={fv['fdl_config'].value!r}: {e}.{hint} Functions "
                             f"in configs.experiments: {', '.join(names)}") from None
        name = getattr(cfg, "name", None) or "experiment"
    elif recorded is not None and not _EXP.value:
        cfg, name = recorded, recorded.name
    else:
        try:
            cls = registry.get_experiment(_EXP.value or DEFAULT_EXP)
        except LookupError as e:
            raise UsageError(str(e)) from None
        cfg = cls().experiment_config()
        name = registry.short_name(cls)
    apply_fiddlers(cfg, exp_module)
    apply_overrides(cfg, fv["fdl_set"].value)
    return cfg, name


class _no_fdl_set:
    """create_buildable_from_flags applies --fiddler and --fdl_set itself with Fiddle's terse
    errors; we apply them afterwards (naming the fiddler, checking the paths), so hide them
    from it."""

    def __init__(self, fv):
        self.fv = fv

    def __enter__(self):
        self.saved = {k: list(self.fv[k].value) for k in ("fdl_set", "fiddler")}
        for k in self.saved:
            self.fv[k].value = []

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            self.fv[k].value = v


# ---------------------------------------------------------------------- the job directory


def _job_log_dir(name: str) -> Path:
    return Path(_JOB_LOG_DIR.value or Path("runs") / name).absolute()


def _load_recorded(job_log_dir: Path):
    try:
        return jobdir.load_recorded(job_log_dir)
    except jobdir.JobDirError as e:
        if not _ALLOW_CONFIG_CHANGE.value:
            raise UsageError(str(e)) from e
        print(f"experiments.main: note: --allow_config_change: {e}", file=sys.stderr, flush=True)
        return None


def config_and_job_dir():
    """(config, name, job_log_dir, the config recorded there or None). With no --exp,
    --fdl_config or --fdl_config_file, the job directory's recorded config is the base config
    (so eval and resume run what the directory holds)."""
    fv = flags.FLAGS
    explicit = _EXP.value or fv["fdl_config"].value or fv["fdl_config_file"].value
    if explicit:
        cfg, name = config_from_flags()
        job_log_dir = _job_log_dir(name)
        return cfg, name, job_log_dir, _load_recorded(job_log_dir)
    job_log_dir = _job_log_dir(DEFAULT_EXP)
    recorded = _load_recorded(job_log_dir)
    cfg, name = config_from_flags(copy.deepcopy(recorded))  # overrides must not edit the record
    return cfg, name, job_log_dir, recorded


def tokenizer_given(cfg, recorded) -> bool:
    """Whether this run names a tokenizer of its own (an override of ``data.tokenizer``, or a
    config whose tokenizer is not the one ``recorded``), rather than running the job
    directory's recorded config, whose tokenizer is the job's kept copy."""
    paths = [a.split("=", 1)[0].strip() for a in flags.FLAGS["fdl_set"].value]
    return recorded is None or "data.tokenizer" in paths or \
        cfg.data.tokenizer != recorded.data.tokenizer


# ------------------------------------------------------------------------------ multi-host


def init_distributed(num_processes: int, process_id: int, coordinator_address) -> None:
    """jax.distributed.initialize for a multi-process job (no-op for one process)."""
    if num_processes < 1:
        raise UsageError(f"--num_processes={num_processes} must be >= 1")
    if num_processes == 1:
        return
    if not 0 <= process_id < num_processes:
        raise UsageError(f"--process_id={process_id} must be in [0, {num_processes})")
    if not coordinator_address:
        raise UsageError("--num_processes > 1 needs --coordinator_address=host:port "
                         "(process 0's address)")
    import jax

    # CPU processes exchange collectives through gloo (harmless where GPUs are used).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes,
                               process_id=process_id)


# ------------------------------------------------------------------------------------ main


def main(argv, stop_signals=None) -> int:
    """The job; ``stop_signals``: the installed ``experiments.train.signals.StopSignals``."""
    if len(argv) > 1:
        raise UsageError(f"unexpected positional arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    if info.answered(config_from_flags, DEFAULT_EXP):  # --list_experiments, --fdl_help
        return 0
    if _MODE.value == "sample":  # the recorded config and newest checkpoint, as they are
        try:
            return sample_cli.run(_job_log_dir(DEFAULT_EXP), progress=not _NO_PROGRESS.value)
        except errors.SampleError as e:
            raise UsageError(str(e)) from None
    cfg, name, job_log_dir, recorded = config_and_job_dir()
    if _MODE.value != "train":  # a mode that reads a job: nothing is created
        try:
            jobdir.check_readable(job_log_dir)
        except jobdir.JobDirError as e:
            raise UsageError(str(e)) from e
    from experiments.train import loop, setup

    setup.resolve_lengths(cfg, recorded)  # the schedule's length: fixed at the first start
    init_distributed(_NUM_PROCESSES.value, _PROCESS_ID.value, _COORDINATOR.value)
    import jax

    try:
        prep = setup.prepare(cfg,
                             job_log_dir=job_log_dir,
                             progress=not _NO_PROGRESS.value,
                             tokenizer_given=tokenizer_given(cfg, recorded))
    except setup.DataError as e:  # the files, not the config
        raise UsageError(str(e)) from None
    except setup.ConfigError as e:
        raise UsageError(f"invalid config: {e}") from None
    chief = jax.process_index() == 0
    try:
        record = jobdir.open_job_dir(job_log_dir,
                                     cfg,
                                     recorded,
                                     train=_MODE.value == "train",
                                     chief=chief,
                                     allow_change=_ALLOW_CONFIG_CHANGE.value)
    except jobdir.JobDirError as e:
        raise UsageError(str(e)) from e
    if chief:
        mesh = dict(zip(prep.mesh.axis_names, prep.mesh.devices.shape))
        print(
            f"experiment {name}: {jax.device_count()} {jax.devices()[0].platform} devices in "
            f"{jax.process_count()} process(es), mesh {mesh}; job_log_dir {job_log_dir}",
            flush=True)
        print(setup.describe_data(prep.dataset, prep.model.vocab_size), flush=True)
        if _MODE.value == "train":  # the job keeps the tokenizer it trains with
            tokenizer_copy.keep_in_job_dir(job_log_dir, prep.tokenizer)
    trainer = loop.Trainer(prep, job_log_dir, progress=not _NO_PROGRESS.value, signals=stop_signals)
    if _MODE.value == "eval":
        try:
            result = trainer.evaluate_latest()
        except (FileNotFoundError, setup.ConfigError) as e:
            raise UsageError(str(e)) from None
        if chief:
            print(json.dumps(result, indent=1))
        return 0
    try:
        result = trainer.run()
        record()  # the checkpoints it holds restored into this config (or there were none)
    except (setup.ConfigError, jobdir.JobDirError) as e:
        raise UsageError(str(e)) from None
    if chief:
        first, last = result.get("first_eval"), result.get("last_eval")
        if result["diverged"]:  # the last eval is not of the final step
            first = last = None
        if result["stopped_by"]:
            print(f"stopped by {result['stopped_by']} at step {result['final_step']}; the "
                  f"checkpoint is saved, rerun the same command to resume.")
        elif result["start_step"] >= prep.config.train.num_steps:
            print(f"nothing to do: {job_log_dir} already holds step {result['start_step']} "
                  f"(train.num_steps={prep.config.train.num_steps}); use another --job_log_dir "
                  "or raise --fdl.train.num_steps")
        if last:
            print(f"held-out loss {first['heldout_loss']:.4f} at step {result['start_step']} -> "
                  if first else "held-out loss ",
                  f"{last['heldout_loss']:.4f} at step {result['final_step']} "
                  f"(perplexity {last['heldout_perplexity']:.3f}, "
                  f"{last['heldout_bits_per_byte']:.4f} bits per byte)",
                  sep="")
        if "compile_seconds" in result:
            print(f"train step compiled in {result['compile_seconds']:.1f} s")
        if result["skipped_steps"]:
            print(f"skipped {result['skipped_steps']} steps whose loss or gradient norm was not "
                  "finite (train.on_nonfinite='skip'; metrics.jsonl marks them skipped=1)")
        print(f"metrics:     {result['metrics']}\ntensorboard: {result['tensorboard']}\n"
              f"checkpoints: {result['checkpoints']}")
        if not (result["stopped_by"] or result["diverged"]) and Path(result["plot"]).exists():
            print(f"plot:        {result['plot']}")
        sys.stdout.flush()
    if result["diverged"]:
        if chief:
            print(f"experiments.main: error: {result['diverged']}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    if result["stopped_by"]:
        return signals.exit_status(signal.Signals[result["stopped_by"]])
    return 0


def _main(argv) -> int:
    with signals.StopSignals() as stop_signals:
        try:
            return main(argv, stop_signals)
        except UsageError as e:
            errors.report(e, verbose=_VERBOSE_ERRORS.value)
            return 2


def run():
    app.run(lambda argv: errors.end_process_on_error(_main(argv)),
            flags_parser=fdl_flags.flags_parser)


if __name__ == "__main__":
    run()
