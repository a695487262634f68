"""Validate an experiment on a machine without its accelerators: trace, don't allocate.

``validate(cfg)`` builds the experiment's mesh from the devices it is given (on a CPU, fake
host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), then runs
``jax.eval_shape`` of the sharded init and of one train step. Nothing is compiled or
allocated; shapes, dtypes, shardings and the whole MoE path (expert-parallel under the mesh)
are traced. It reports the parameter count and the per-device bytes of the training state
(parameters + optimizer moments) implied by the shardings.

  XLA_FLAGS=--xla_force_host_platform_device_count=256 \
      python -m experiments.validate --exp=deepseek_v3
"""

from __future__ import annotations

import json
import math
import time

import fiddle as fdl
import jax
import numpy as np
from absl import flags, logging

from experiments.train import setup, steps


def _per_device_bytes(abstract_state) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(abstract_state):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def validate(cfg, devices=None) -> dict:
    """eval_shape of init and one train step of ``cfg`` on its mesh. Returns a report:
    mesh, num_params, state_bytes_per_device, loss shape/dtype, seconds taken."""
    t0 = time.perf_counter()
    if devices is None:
        # A preset with a fixed mesh shape uses the first prod(shape) fake devices.
        shape = tuple(fdl.build(cfg.mesh).shape) if isinstance(cfg.mesh, fdl.Buildable) else ()
        devices = jax.devices()[:math.prod(shape)] if shape and -1 not in shape else None
    prep = setup.prepare(cfg, devices=devices)
    fns = steps.make_step_fns(prep)
    exp = prep.config
    b, s = exp.data.batch_size, exp.data.seq_len
    batch = {
        "ids": jax.ShapeDtypeStruct((b, s), np.int32, sharding=fns.batch_sharding),
        "labels": jax.ShapeDtypeStruct((b, s), np.int32, sharding=fns.batch_sharding),
        "weights": jax.ShapeDtypeStruct((b, s), np.float32, sharding=fns.batch_sharding),
    }
    with jax.set_mesh(prep.mesh):
        state = jax.eval_shape(fns.init, jax.random.key(0))
        new_state, metrics = jax.eval_shape(fns.train, fns.abstract_state, batch)
    same = jax.tree_util.tree_map(lambda a, c: (a.shape, a.dtype) == (c.shape, c.dtype), state,
                                  new_state)
    if not all(jax.tree_util.tree_leaves(same)):
        raise AssertionError("the train step changes the state's shapes or dtypes")
    num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state["params"]))
    return {
        "experiment": exp.name,
        "mesh": dict(zip(prep.mesh.axis_names, prep.mesh.devices.shape)),
        "num_params": int(num_params),
        "state_bytes_per_device": int(_per_device_bytes(fns.abstract_state)),
        "loss": [list(metrics["loss"].shape),
                 str(metrics["loss"].dtype)],
        "expert_load_shape":
        list(metrics["expert_load"].shape) if "expert_load" in metrics else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv):
    from experiments import main as main_lib

    if len(argv) > 1:
        raise main_lib.UsageError(f"unexpected positional arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # JAX's INFO lines (no libtpu, ...) are noise here
        logging.set_verbosity(logging.WARNING)
    cfg, _ = main_lib.config_from_flags()
    print(json.dumps(validate(cfg)))


if __name__ == "__main__":
    from absl import app
    from fiddle import absl_flags as fdl_flags

    from experiments import main as _flags  # noqa: F401  (defines --exp and friends)

    app.run(main, flags_parser=fdl_flags.flags_parser)
