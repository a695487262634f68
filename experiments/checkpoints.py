"""Orbax checkpoints of the whole train state {step, params, opt_state, non_trainable}.

Every process writes its own shards; a restore reads them back with the state's shardings (the
abstract state of ``experiments.steps.StepFns``), so a resumed run continues bitwise where it
stopped.
"""

from __future__ import annotations

from pathlib import Path

from experiments.setup import ConfigError


class Checkpoints:
    """The checkpoints in ``ckpt_dir``: at most ``max_to_keep`` of them, restored into
    ``abstract_state`` (a pytree of ShapeDtypeStruct with shardings)."""

    def __init__(self, ckpt_dir, max_to_keep: int, abstract_state):
        self.ckpt_dir = Path(ckpt_dir)
        self.max_to_keep = max_to_keep
        self.abstract_state = abstract_state

    def manager(self):
        """A new orbax CheckpointManager (close it when done)."""
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True)
        return ocp.CheckpointManager(self.ckpt_dir, options=opts)

    def save(self, mngr, state, step: int):
        """Saves ``state`` as ``step`` unless that step is already the latest checkpoint."""
        import orbax.checkpoint as ocp

        if mngr.latest_step() == step:
            return
        mngr.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore_or_init(self, mngr, init):
        """(state, restored step): the latest checkpoint, else ``init()`` and None."""
        latest = mngr.latest_step()
        if latest is None:
            return init(), None
        return self.restore(mngr, latest), latest

    def restore(self, mngr, step: int):
        """The state saved as ``step``; ConfigError if it does not fit this experiment."""
        import orbax.checkpoint as ocp

        try:
            return mngr.restore(step, args=ocp.args.StandardRestore(self.abstract_state))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"the checkpoint of step {step} in {self.ckpt_dir} does not fit this "
                f"experiment's state (written by a different model or optimizer config?); use "
                f"another --job_log_dir. orbax said: {e}") from e
