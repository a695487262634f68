"""Orbax checkpoints of the whole train state {step, params, opt_state, non_trainable}.

Every process writes its own shards; a restore reads them back with the state's shardings (the
abstract state of ``experiments.train.steps.StepFns``), so a resumed run continues bitwise where it
stopped.

- A state holding a NaN or an infinity is never written: ``save`` raises ``NonFiniteState``.
- ``restore_newest`` takes the newest checkpoint that restores and holds only finite values;
  each newer one that does not is reported in one line (why) and, when training, moved to
  ``<job_log_dir>/checkpoints_damaged/`` so that the run can write its step again.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from experiments.train.setup import ConfigError

DAMAGED_DIR = "checkpoints_damaged"


class NonFiniteState(ValueError):
    """A train state holding a NaN or an infinity: it is not saved."""


_SHORT_READ = re.compile(r'file "([^"]+)": Requested byte range \[\d+, (\d+)\) is not valid '
                         r'for value of size (\d+)')
_VALUE = re.compile(r'Error reading "([^"]+)" in OCDBT database at local file "[^"]+": $')


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: tensorstore's messages embed kilobytes of JSON specs and
    pytree errors span several lines. orbax wraps a failed array read in an exception whose text
    is the array's TensorStore spec (``See full TensorStore details: ...``): the reason is the
    error it was raised from, whose text is used."""
    while e.__cause__ is not None and "TensorStore details" in str(e):
        e = e.__cause__
    text = " ".join(str(e).split()).split(" [tensorstore_spec")[0]
    short = _SHORT_READ.search(text)
    if short:  # the usual damage: a data file cut short (a copy or a save that did not finish)
        path, want, have = short.groups()
        value = _VALUE.search(text[:short.start()] + f'file "{path}": ')
        what = f"array chunk {value.group(1)} in {path}" if value else f"data file {path}"
        return f"{what} is truncated: {have} bytes, a read needs {want}"
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _DropFailedReadTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports of orbax reads: when a
    restore fails, the reads of its other arrays still fail in tasks nobody awaits, and asyncio
    logs each with a traceback at exit. The restore's failure is already reported in one line;
    any other task's exception still gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Task exception was never retrieved"):
            return True
        e = record.exc_info[1] if record.exc_info else None
        tb = e.__traceback__ if e is not None else None
        while tb is not None:
            if "orbax" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


_ASYNCIO_FILTER = _DropFailedReadTasks()


def _drop_closed_loop_errors():
    """Tensorstore reads still in flight when a restore failed complete after orbax has closed
    its event loop; their callbacks raise 'Event loop is closed' where nothing can catch it and
    Python prints each as a traceback (and asyncio logs the reads that failed in unawaited
    tasks). The restore has already failed and been reported, so exactly those are dropped;
    every other unraisable exception still reaches the old hook."""
    logging.getLogger("asyncio").addFilter(_ASYNCIO_FILTER)  # adding it twice is a no-op
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_errors", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(unraisable)

    hook.drops_closed_loop_errors = True
    sys.unraisablehook = hook

    # The same error raised in a callback of a thread tensorstore started is printed through
    # sys.excepthook / threading.excepthook instead (seen under load): dropped there too.
    previous_except, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, value, tb):
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous_except(kind, value, tb)

    def thread_hook(args):
        e = args.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            previous_thread(args)

    sys.excepthook, threading.excepthook = excepthook, thread_hook


def _on_every_process(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a process that cannot read its shards of a
    checkpoint makes the checkpoint unusable for all)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


class Checkpoints:
    """The checkpoints in ``ckpt_dir``: at most ``max_to_keep`` of them, restored into
    ``abstract_state`` (a pytree of ShapeDtypeStruct with shardings)."""

    def __init__(self,
                 ckpt_dir,
                 max_to_keep: int,
                 abstract_state,
                 host_gb: int | None = None,
                 pinned_host: bool | None = None):
        """``host_gb``: at most that many GB of the state copied from the devices to the host
        at once while saving (orbax's ``save_device_host_concurrent_gb``; None: orbax copies
        the whole state first). ``pinned_host``: whether that copy goes through pinned host
        memory (orbax's ``enable_pinned_host_transfer``; None: orbax's default, on for GPUs).
        The checkpoint is the same either way."""
        self.ckpt_dir = Path(ckpt_dir)
        self.max_to_keep = max_to_keep
        self.abstract_state = abstract_state
        self.host_gb = host_gb
        self.pinned_host = pinned_host
        self._finite = None

    def handler_options(self) -> dict:
        """The options of orbax's PyTreeCheckpointHandler that differ from its defaults ({}:
        the default handler, StandardSave)."""
        opts = {}
        if self.host_gb is not None:
            opts["save_device_host_concurrent_gb"] = self.host_gb
        if self.pinned_host is not None:
            opts["enable_pinned_host_transfer"] = self.pinned_host
        return opts

    def manager(self, create: bool = True):
        """A new orbax CheckpointManager (close it when done); ``create=False`` (reading a
        job) creates no directory."""
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=create)
        if not self.handler_options():
            return ocp.CheckpointManager(self.ckpt_dir, options=opts)
        # The pytree handler that StandardSave wraps, with the copy to the host bounded or
        # unpinned; the files are the same, so StandardRestore reads them.
        handler = ocp.PyTreeCheckpointHandler(**self.handler_options())
        return ocp.CheckpointManager(self.ckpt_dir, options=opts, item_handlers=handler)

    def nonfinite(self, state) -> str | None:
        """None if every float of ``state`` is finite, else the paths of the leaves that are
        not (the first three and how many more)."""
        if self._finite is None:
            mesh = jax.tree_util.tree_leaves(self.abstract_state)[0].sharding.mesh
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

            def finite(x):
                if not jnp.issubdtype(x.dtype, jnp.inexact):
                    return jnp.bool_(True)
                return jnp.all(jnp.isfinite(x))

            self._finite = jax.jit(lambda st: jax.tree_util.tree_map(finite, st),
                                   out_shardings=replicated)
        flags = jax.device_get(self._finite(state))
        bad = [
            jax.tree_util.keystr(path)
            for path, ok in jax.tree_util.tree_flatten_with_path(flags)[0] if not ok
        ]
        if not bad:
            return None
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return ", ".join(bad[:3]) + more

    def save(self, mngr, state, step: int):
        """Saves ``state`` as ``step`` unless that step is already the latest checkpoint.
        Raises NonFiniteState (writing nothing) if the state holds a NaN or an infinity."""
        import orbax.checkpoint as ocp

        if mngr.latest_step() == step:
            return
        bad = self.nonfinite(state)
        if bad is not None:
            raise NonFiniteState(f"the state of step {step} holds non-finite values in {bad}; "
                                 "it was not saved")
        args = (ocp.args.PyTreeSave(state)
                if self.handler_options() else ocp.args.StandardSave(state))
        mngr.save(step, args=args, force=True)

    def _try_restore(self, mngr, step: int):
        """(state, None) or (None, why the checkpoint of ``step`` is unusable, one line)."""
        import orbax.checkpoint as ocp

        # Before the restore, not after its failure: reads still in flight when it fails can
        # complete (and print) before the except clause runs (seen under load).
        _drop_closed_loop_errors()
        try:
            state = mngr.restore(step, args=ocp.args.StandardRestore(self.abstract_state))
        except Exception as e:  # orbax and tensorstore raise many types for a damaged file
            why = one_line(e)
            if not any((self.ckpt_dir / str(step)).glob("*/_METADATA")):
                why = f"its _METADATA file is missing; {one_line(e, 120)}"
            return None, why
        bad = self.nonfinite(state)
        if bad is not None:
            return None, f"it holds non-finite values in {bad}"
        return state, None

    def _set_aside(self, step: int) -> Path:
        """Moves the checkpoint of ``step`` into ``../checkpoints_damaged/`` (process 0)."""
        dest_dir = self.ckpt_dir.parent / DAMAGED_DIR
        dest, n = dest_dir / str(step), 1
        while dest.exists():
            dest, n = dest_dir / f"{step}.{n}", n + 1
        if jax.process_index() == 0:
            dest_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.ckpt_dir / str(step)), str(dest))
        return dest

    def restore_newest(self, mngr, *, set_aside: bool):
        """(state, step, notes) from the newest checkpoint that restores and holds only finite
        values; (None, None, []) when there is no checkpoint. ``notes``: one line for each newer
        checkpoint passed over, saying why (and where it was moved when ``set_aside``). Raises
        ConfigError (one line, every checkpoint and why) when checkpoints exist and none
        restores."""
        steps = sorted(mngr.all_steps(), reverse=True)
        passed = []
        for step in steps:
            state, why = self._try_restore(mngr, step)
            if _on_every_process(why is None):
                break
            passed.append((step, why or "another process could not restore its shards"))
        else:
            if not steps:
                return None, None, []
            whys = "; ".join(f"the checkpoint of step {s} does not fit this experiment's state or "
                             f"is damaged ({why})" for s, why in passed)
            raise ConfigError(f"no checkpoint in {self.ckpt_dir} restores: {whys}. Written by a "
                              "different model or optimizer config? use another --job_log_dir")
        notes = []
        for s, why in passed:
            note = f"checkpoint {s} in {self.ckpt_dir} does not restore ({why})"
            if set_aside:
                note += f"; moved to {self._set_aside(s)}"
            notes.append(note + "; skipped")
        if passed and set_aside:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("checkpoints set aside")
            mngr.reload()
        return state, step, notes
