"""What a job directory holds: the experiment config it was started with.

The first start of a run in a ``job_log_dir`` records the resolved experiment config (after
every ``--fiddler`` and ``--fdl`` override) in ``job_log_dir/config.json``, Fiddle's own
serialization (``fiddle.experimental.serialization.dump_json``; ``--fdl_config_file`` reads it
back). A later start (resume, or ``--mode=eval``) compares its config with the record:

- with no ``--exp``, ``--fdl_config`` or ``--fdl_config_file`` the record IS the base config
  (``experiments.main.config_and_job_dir``), so ``--mode=eval --job_log_dir=D`` evaluates
  what D trained on;
- a config that differs from the record anywhere but the loop fields of ``LOOP_FIELDS`` (how
  long to train and how often to evaluate and save: they say when, not what) and
  ``EXECUTION_FIELDS`` (how a step is run: ``train.grad_accum_steps``) is refused with one
  line naming the job directory and every differing path, unless ``--allow_config_change``:
  then training records the new config once the directory's checkpoints restore into it (the
  old record is kept as ``config.replaced.<n>.json``) and eval just uses the given config;
- a field the config leaves None for the start to resolve (``data.source``, the model's
  vocabulary taken from the tokenizer) is no change where the record holds the value None
  resolves to: records made before the data pipeline hold ``source='pydoc'`` and 256.
"""

from __future__ import annotations

import copy
import difflib
import os
import sys
import tempfile
from pathlib import Path

import fiddle as fdl
from fiddle.experimental import serialization

import moe_praxis  # noqa: F401  (Praxis's shims, before a record's references import praxis)
from experiments.train import setup
from experiments import tokenizer as tokenizer_lib

CONFIG_FILE = "config.json"
# Fields that may differ between starts of one run: they change when the run stops, evaluates
# or saves, not what it computes at a step.
LOOP_FIELDS = frozenset({
    "train.num_steps", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
    "train.max_checkpoints", "train.summary_every", "train.sigterm_at_step", "train.on_nonfinite",
    "train.max_skipped_steps", "train.eval_on_restore"
})
# Fields that change how a step is run, not its batch, model, optimizer or schedule: they may
# differ between starts too (the steps after the change differ from an uninterrupted run's by
# float rounding and, for batch-level statistics such as the 'switch' aux loss and capacity
# drops, by the micro-batches' own statistics).
EXECUTION_FIELDS = frozenset({"train.grad_accum_steps"})
_MISSING = object()
_SHOWN = 6  # differing paths named in the one-line error; the rest are counted


class JobDirError(ValueError):
    """A job directory that does not hold this run (one line, exit status 2)."""


def config_path(job_log_dir) -> Path:
    return Path(job_log_dir) / CONFIG_FILE


def load_recorded(job_log_dir):
    """The config recorded in ``job_log_dir`` (None when there is no record). Raises
    JobDirError naming the file when it cannot be read back."""
    path = config_path(job_log_dir)
    if not path.is_file():
        return None
    try:
        return serialization.load_json(path.read_text())
    except (OSError, ValueError, TypeError, AttributeError, ImportError, KeyError) as e:
        raise JobDirError(f"{path} does not read back as a Fiddle config ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}); restore it, use another "
                          "--job_log_dir, or pass --allow_config_change to record this run's "
                          "config in its place") from e


def _short(value) -> str:
    if isinstance(value, fdl.Buildable):
        fn = fdl.get_callable(value)
        text = f"{type(value).__name__}[{getattr(fn, '__qualname__', fn)}]"
    else:
        text = "(not set)" if value is _MISSING else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_leaf(a, b) -> bool:
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # numpy arrays compare elementwise
        return repr(a) == repr(b)


def _diff(a, b, path: str, out: list) -> None:
    if isinstance(a, fdl.Buildable) and isinstance(b, fdl.Buildable):
        if type(a) is not type(b) or fdl.get_callable(a) != fdl.get_callable(b):
            out.append((path, a, b))
            return
        aa = fdl.ordered_arguments(a, include_defaults=True)
        bb = fdl.ordered_arguments(b, include_defaults=True)
        for k in dict.fromkeys([*aa, *bb]):
            _diff(aa.get(k, _MISSING), bb.get(k, _MISSING), f"{path}.{k}" if path else k, out)
    elif isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            _diff(a[k], b[k], f"{path}[{k!r}]", out)
    elif not _same_leaf(a, b):
        out.append((path, a, b))


def _vocab_from_tokenizer(cfg):
    """The model vocabulary the job takes from its tokenizer when model.vocab_size is None
    (experiments.train.setup), or _MISSING when the tokenizer does not load."""
    try:
        n = tokenizer_lib.load_tokenizer(cfg.data.tokenizer).vocab_size
    except (ValueError, OSError):
        return _MISSING
    return -(-n // setup.VOCAB_MULTIPLE) * setup.VOCAB_MULTIPLE


# Fields a config may leave None that the job resolves when it starts -> what None resolves to.
# Job directories recorded before the data pipeline hold the resolved value: the same run.
_RESOLVED_AT_START = {
    "data.source": lambda cfg: fdl.build(copy.deepcopy(cfg.data)).resolved_source,
    "model.vocab_size": _vocab_from_tokenizer,
    "model.softmax_tpl.num_classes": _vocab_from_tokenizer,
}


def _resolved_alike(path: str, recorded_value, given_value, cfg) -> bool:
    """True where this start leaves `path` None and the record holds what None resolves to."""
    if given_value is not None or recorded_value is None or path not in _RESOLVED_AT_START:
        return False
    try:
        resolved = _RESOLVED_AT_START[path](cfg)
    except (AttributeError, TypeError, ValueError):  # not an experiment config: compare as is
        return False
    return _same_leaf(recorded_value, resolved)


def differences(recorded, cfg, *, ignore=LOOP_FIELDS | EXECUTION_FIELDS) -> list[str]:
    """``path: recorded -> given`` for every leaf where ``cfg`` differs from ``recorded``,
    leaving out the paths in ``ignore`` and a field ``cfg`` leaves to the start to resolve
    (data.source, the vocabulary) where the record holds its resolved value. ``cfg`` is compared
    as it reads back from its own serialization, so only what the record can hold is compared."""
    out = []
    _diff(recorded, serialization.load_json(serialization.dump_json(cfg)), "", out)
    return [
        f"{p}: {_short(a)} -> {_short(b)}" for p, a, b in out
        if p not in ignore and not _resolved_alike(p, a, b, cfg)
    ]


def check_writable(job_log_dir) -> None:
    """Creates ``job_log_dir`` and writes a scratch file in it: a directory the run cannot
    write is a JobDirError now, not an OSError after compiling."""
    job_log_dir = Path(job_log_dir)
    try:
        job_log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=job_log_dir):
            pass
    except OSError as e:
        raise JobDirError(f"--job_log_dir={str(job_log_dir)!r} is not a directory this job can "
                          f"write ({type(e).__name__}: {e.strerror or e}); give a writable "
                          "--job_log_dir") from e


def record(job_log_dir, cfg) -> Path | None:
    """Writes ``cfg`` to ``job_log_dir/config.json`` (atomically; an existing record is kept
    as ``config.replaced.<n>.json``). Returns the path, or None when ``cfg`` cannot be
    serialized (reported in one line on stderr: the run goes on without a record)."""
    path = config_path(job_log_dir)
    try:
        text = serialization.dump_json(cfg, indent=1)
    except (TypeError, ValueError) as e:
        print(
            f"experiments.main: warning: the config cannot be recorded in {path} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); resume and eval cannot "
            "check it",
            file=sys.stderr,
            flush=True)
        return None
    if path.exists():
        n = 1
        while (path.parent / f"config.replaced.{n}.json").exists():
            n += 1
        path.rename(path.parent / f"config.replaced.{n}.json")
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def check(job_log_dir, cfg, recorded, *, allow_change: bool) -> list[str]:
    """Compares ``cfg`` with the ``recorded`` config of ``job_log_dir`` (None: no record).
    Returns the differences (empty when they agree); raises JobDirError (one line: the job
    directory, the recorded experiment and the differing paths) unless ``allow_change``."""
    if recorded is None:
        return []
    diffs = differences(recorded, cfg)
    if diffs and not allow_change:
        more = f" and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else ""
        raise JobDirError(
            f"--job_log_dir={str(job_log_dir)!r} holds a run of experiment "
            f"{getattr(recorded, 'name', '?')!r} whose config ({CONFIG_FILE}) differs from this "
            f"one at {'; '.join(diffs[:_SHOWN])}{more}. Run it with the flags it was started "
            "with (with no --exp, --fdl_config or --fdl_config_file its recorded config is "
            "used), use another --job_log_dir, or pass --allow_config_change")
    return diffs


def _note(line: str) -> None:
    print(f"experiments.main: note: {line}", file=sys.stderr, flush=True)


def _has_checkpoints(job_log_dir: Path) -> bool:
    ckpts = job_log_dir / "checkpoints"
    return ckpts.is_dir() and any(d.name.isdigit() for d in ckpts.iterdir())


def _nothing() -> None:
    return None


def check_readable(job_log_dir: Path) -> None:
    """A mode that reads a job (eval) needs its directory: a missing one is a JobDirError
    naming the runs beside it that are close, and nothing is created."""
    if job_log_dir.is_dir():
        return
    parent = job_log_dir.parent
    runs = sorted(d.name for d in parent.iterdir()
                  if d.is_dir() and ((d / CONFIG_FILE).is_file() or _has_checkpoints(d))) \
        if parent.is_dir() else []
    close = difflib.get_close_matches(job_log_dir.name, runs, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(str(parent / c) for c in close)}? " if close else ""
    raise JobDirError(f"--job_log_dir={str(job_log_dir)!r} does not exist, so there is no run "
                      f"to read; {hint}Give the directory of a trained run (train first to "
                      "make one)")


def open_job_dir(job_log_dir, cfg, recorded, *, train: bool, chief: bool, allow_change: bool):
    """Everything a start does to its job directory before tracing: compares ``cfg`` with the
    ``recorded`` config (``check``); when training, checks that the directory can be written
    and has process 0 record ``cfg`` at the first start, or when ``allow_change`` let a
    different config in. Raises JobDirError (one line).

    Returns what to call once the run has restored the directory's checkpoints (the trainer
    returned): a directory that holds checkpoints records a new config only when they fit it,
    so a refused restore leaves the record as it was. A fresh directory is recorded at once."""
    job_log_dir = Path(job_log_dir)
    diffs = check(job_log_dir, cfg, recorded, allow_change=allow_change)
    if train:
        check_writable(job_log_dir)
    if not chief:
        return _nothing
    path = config_path(job_log_dir)
    later = _has_checkpoints(job_log_dir)
    when = " once its checkpoints restore" if later else ""
    if diffs:
        kept = (f"; recording it{when} (the old record is kept as config.replaced.<n>.json)"
                if train else "")
        _note(f"--allow_config_change: this config differs from {path} at "
              f"{'; '.join(diffs)}{kept}")
    if not train or not (diffs or recorded is None):
        return _nothing
    if recorded is None and not path.exists() and later:
        _note(f"{job_log_dir} holds checkpoints but no {CONFIG_FILE} (written before configs "
              f"were recorded): recording this run's config{when}")

    def commit() -> None:
        try:
            record(job_log_dir, cfg)
        except OSError as e:
            raise JobDirError(f"--job_log_dir={str(job_log_dir)!r}: cannot write {path} "
                              f"({type(e).__name__}: {e})") from e

    if later:
        return commit
    commit()
    return _nothing
