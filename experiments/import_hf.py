r"""Import a Hugging Face checkpoint of Mixtral, Qwen3-MoE or OLMoE as a job directory.

  python -m experiments.import_hf --model_dir DIR --job_log_dir OUT \
      [--arch auto|mixtral|qwen3_moe|olmoe] [--data_path TEXTS] [--seq_len 512] \
      [--batch_size 8] [--dtype float32|bfloat16] [--repeat] [--remat] \
      [--mesh_shape 1,8 --mesh_axes data,expert --ep expert [--fsdp AXIS]]

OUT then holds what a trained job holds: ``config.json`` (the experiment, ``configs.hf``), the
tokenizer copy (``tokenizer/``: DIR's tokenizer.json and its hash) and an orbax checkpoint of
step 0 whose parameters are the checkpoint's (the optimizer's moments zero). So
``python -m experiments.main --mode=sample --job_log_dir=OUT --prompt=...`` continues text
with it, ``--mode=eval`` evaluates it on ``--data_path``'s held-out tail, and
``python -m experiments.main --job_log_dir=OUT`` fine-tunes it from step 0.

Every check comes before anything is written (``experiments.hf.checkpoint``,
``experiments.hf.convert``): the architecture, the config fields this port does not implement
that the checkpoint uses, each shard's presence and each tensor's name and shape. The job
directory is written under a temporary name beside OUT and renamed into place at the end, so a
failed import leaves nothing behind. Shards are read one at a time (host memory: the model's
float32 parameters plus one shard); on a mesh with an expert axis each EP rank receives only
its experts' weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging

from configs.hf import ARCHS, imported_experiment
from experiments.hf import convert as hf_convert
from experiments.job import jobdir
from experiments.train import setup, steps
from experiments.tokenizer import job_copy as tokenizer_copy
from experiments.train.checkpoints import Checkpoints
from experiments.hf.checkpoint import TOKENIZER, HfImportError, Shards, read_config

FPROP_DTYPES = ("float32", "bfloat16")
# GB of the train state copied from the devices to the host at once while the checkpoint is
# written (experiments.checkpoints.Checkpoints host_gb).
SAVE_HOST_GB = 4
# Whether that copy goes through pinned host memory (orbax's enable_pinned_host_transfer, on by
# default on GPUs). Off: measured on an H100 (2 layers of Qwen3-30B-A3B, orbax-checkpoint
# 0.12.4), the host peak while writing the checkpoint is 27.3 GiB off against 39.3 GiB on, and
# the import takes 45 s against 54 s (docs/experiments.md).
SAVE_PINNED_HOST = False


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m experiments.import_hf",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", required=True, help="the Hugging Face model folder")
    ap.add_argument("--job_log_dir", required=True, help="the job directory to write (new)")
    ap.add_argument("--arch", default="auto", choices=("auto", *ARCHS))
    ap.add_argument("--data_path",
                    default=None,
                    help="documents to fine-tune and evaluate on (data.path); default: the "
                    "model folder, which holds none: give --fdl.data.path and "
                    "--allow_config_change to train or evaluate then")
    ap.add_argument("--seq_len",
                    type=int,
                    default=512,
                    help="data.seq_len (and the context "
                    "length of sampling)")
    ap.add_argument("--batch_size", type=int, default=8, help="data.batch_size")
    ap.add_argument("--dtype",
                    default="float32",
                    choices=FPROP_DTYPES,
                    help="the activations' dtype (parameters stay float32)")
    ap.add_argument("--repeat", action="store_true", help="a scanned stack of the layers")
    ap.add_argument("--remat", action="store_true", help="rematerialise in the backward")
    ap.add_argument("--mesh_shape", default=None, help="e.g. 1,8 (default: data parallel)")
    ap.add_argument("--mesh_axes", default=None, help="e.g. data,expert")
    ap.add_argument("--dp", default=None, help="the data-parallel axis (default: the first)")
    ap.add_argument("--fsdp", default=None, help="the fsdp axis")
    ap.add_argument("--ep", default=None, help="the expert-parallel axis")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def _mesh(args) -> dict | None:
    if args.mesh_shape is None and args.mesh_axes is None:
        for flag in ("dp", "fsdp", "ep"):
            if getattr(args, flag) is not None:
                raise HfImportError(f"--{flag}={getattr(args, flag)!r} needs --mesh_shape and "
                                    "--mesh_axes")
        return None
    if args.mesh_shape is None or args.mesh_axes is None:
        raise HfImportError(f"--mesh_shape={args.mesh_shape!r} and --mesh_axes="
                            f"{args.mesh_axes!r}: give both, e.g. --mesh_shape=1,8 "
                            "--mesh_axes=data,expert --ep=expert")
    try:
        shape = tuple(int(s) for s in args.mesh_shape.split(","))
    except ValueError:
        raise HfImportError(f"--mesh_shape={args.mesh_shape!r} is invalid: comma-separated "
                            "ints, e.g. 1,8") from None
    axes = tuple(a.strip() for a in args.mesh_axes.split(","))
    return dict(shape=shape,
                axis_names=axes,
                dp=args.dp if args.dp is not None else axes[0],
                fsdp=args.fsdp,
                ep=args.ep)


def _new_job_dir(job_log_dir: Path) -> None:
    if job_log_dir.exists() and (not job_log_dir.is_dir() or any(job_log_dir.iterdir())):
        raise HfImportError(f"--job_log_dir={str(job_log_dir)!r} exists and is not empty: "
                            "the import writes a new job directory; give another")
    if not job_log_dir.parent.is_dir():
        raise HfImportError(f"--job_log_dir={str(job_log_dir)!r}: its parent directory does "
                            "not exist")


def import_checkpoint(model_dir,
                      job_log_dir,
                      *,
                      arch: str = "auto",
                      data_path=None,
                      seq_len: int = 512,
                      batch_size: int = 8,
                      dtype: str = "float32",
                      repeat: bool = False,
                      remat: bool = False,
                      mesh: dict | None = None,
                      progress: bool = False,
                      pinned_host: bool | None = SAVE_PINNED_HOST) -> Path:
    """Writes the job directory ``job_log_dir`` of the checkpoint in ``model_dir`` (see the
    module docstring); returns its path. Raises HfImportError (one line) before writing
    anything for an input this port cannot import. ``pinned_host``: whether the checkpoint's
    copy to the host goes through pinned host memory (Checkpoints' option; default
    SAVE_PINNED_HOST, off; None: orbax's default, on for GPUs)."""
    model_dir = Path(model_dir).absolute()
    job_log_dir = Path(job_log_dir).absolute()
    spec = read_config(model_dir, arch)
    tokenizer = model_dir / TOKENIZER
    if not tokenizer.is_file():
        raise HfImportError(f"{tokenizer} does not exist: the import keeps the model's "
                            "tokenizer.json in the job directory")
    shards = Shards(model_dir)
    plan = hf_convert.plan(spec, shards, repeat=repeat)
    _new_job_dir(job_log_dir)
    try:
        cfg = imported_experiment(
            spec,
            name=f"hf_{spec.arch}",
            tokenizer=str(tokenizer),
            data_path=str(Path(data_path).absolute()) if data_path else str(model_dir),
            seq_len=seq_len,
            batch_size=batch_size,
            fprop_dtype=dtype,
            repeat=repeat,
            remat=remat,
            mesh=mesh)
        setup.resolve_lengths(cfg)
        prep = setup.prepare(cfg, load_data=False)
    except ValueError as e:  # ConfigError, and a MeshConfig the fiddler could not build
        raise HfImportError(f"{model_dir}: the imported model does not set up: {e}") from None
    fns = steps.make_step_fns(prep)
    plan.check_params(fns.abstract_state["params"])
    # Each stage is logged as it starts ("import: <stage>"): benchmarks/hf_import_train.py
    # measures the host memory of each.
    logging.info("import: reading the shards")
    flat = plan.read(shards, progress=progress)

    # Parameters placed with the training sharding (each EP rank gets its experts' slices),
    # the optimizer state made on the devices from them.
    sharding = fns.state_sharding
    logging.info("import: placing the parameters")
    params = hf_convert.param_tree(flat)
    params = jax.tree_util.tree_map(lambda x, s: jax.device_put(x, s), params, sharding["params"])
    del flat
    tx, _ = steps.make_optimizer(prep.config.optimizer, prep.config.train.num_steps)
    logging.info("import: making the train state")
    with jax.set_mesh(prep.mesh):
        state = jax.jit(lambda p: {
            "step":
            jnp.zeros((), jnp.int32),
            "params":
            p,
            "opt_state":
            tx.init(p),
            "non_trainable":
            jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), fns.abstract_state[
                "non_trainable"])
        },
                        out_shardings=sharding)(params)
    del params

    tmp = Path(tempfile.mkdtemp(prefix=f".{job_log_dir.name}.import.", dir=job_log_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # a directory as mkdir makes it, not mkdtemp's private one
    try:
        # The whole train state (parameters and two moments) is written in one go: copied to
        # the host a few GB at a time, not all at once (the import's host peak).
        ckpts = Checkpoints(tmp / "checkpoints",
                            prep.config.train.max_checkpoints,
                            fns.abstract_state,
                            host_gb=SAVE_HOST_GB,
                            pinned_host=pinned_host)
        mngr = ckpts.manager()
        logging.info("import: writing the checkpoint")
        try:
            with jax.set_mesh(prep.mesh):
                ckpts.save(mngr, state, 0)
            mngr.wait_until_finished()
        finally:
            mngr.close()
        if jobdir.record(tmp, cfg) is None:
            raise HfImportError(f"the imported config of {model_dir} cannot be recorded")
        tokenizer_copy.keep_in_job_dir(tmp, prep.tokenizer)
        if job_log_dir.exists():
            job_log_dir.rmdir()  # empty (checked above)
        os.replace(tmp, job_log_dir)
        logging.info("import: done")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return job_log_dir


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = import_checkpoint(args.model_dir,
                                args.job_log_dir,
                                arch=args.arch,
                                data_path=args.data_path,
                                seq_len=args.seq_len,
                                batch_size=args.batch_size,
                                dtype=args.dtype,
                                repeat=args.repeat,
                                remat=args.remat,
                                mesh=_mesh(args),
                                progress=not args.no_progress)
    except HfImportError as e:
        print(f"experiments.import_hf: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"imported {args.model_dir} into {out}: sample with python -m experiments.main "
          f"--mode=sample --job_log_dir={out} --prompt=..., fine-tune with python -m "
          f"experiments.main --job_log_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
