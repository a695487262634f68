"""Helpers shared by the tests: fresh seeds, the norm-wise relative error, poisoned device
memory and the repository's own files."""

import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from moe_praxis import MoEConfig


def long_options(parser) -> set[str]:
    """The --options of an argparse parser (--help left out), for the docs-in-step tests."""
    return {
        o
        for a in parser._actions
        for o in a.option_strings if o.startswith("--") and o != "--help"
    }


REPO = Path(__file__).resolve().parent.parent


def repo_files(suffixes=None, under: str = "") -> list[Path]:
    """The repository's own files (below the folder ``under``; with one of ``suffixes``, None:
    any): git's tracked and untracked but not ignored files, so never the .venv, build outputs
    or caches a checkout holds (where git is absent: every file outside a dot-folder, build/ and
    __pycache__)."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", under or "."],
                       cwd=REPO,
                       capture_output=True,
                       text=True)
    if r.returncode == 0:
        files = [REPO / line for line in r.stdout.splitlines()]
    else:
        skip = {"build", "__pycache__"}
        files = [
            p for p in (REPO / under).rglob("*")
            if not any(part.startswith(".") or part in skip for part in p.relative_to(REPO).parts)
        ]
    return sorted(p for p in files if p.is_file() and (suffixes is None or p.suffix in suffixes))


def seed() -> int:
    """A fresh random seed every call (print it in failure messages to reproduce)."""
    return int(np.random.SeedSequence().generate_state(1)[0])


def poison(nbytes: int = 1 << 30):
    """Fills `nbytes` of device memory with NaN and frees it: outputs a kernel then leaves
    unwritten (taken from that freed memory) show up as NaN."""
    a = jnp.full((nbytes // 4, ), jnp.nan, jnp.float32)
    a.block_until_ready()
    a.delete()


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64 (inf if got has NaN / inf where want is finite)."""
    return sum_err(got, want, want)


def row_errs(got, want) -> np.ndarray:
    """||got - want|| / ||want|| along the last axis, one per row, in float64 (inf for a row of
    got with NaN / inf)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(g - w, axis=-1) / np.maximum(np.linalg.norm(w, axis=-1), 1e-30)
    return np.where(np.all(np.isfinite(g), axis=-1), err, np.inf)


def sum_err(got, want, scale) -> float:
    """||got - want|| / ||scale|| in float64, for sums whose terms may cancel: scale is the sum
    of the terms' magnitudes (a float32 sum is exact to a few ulps of that, not of the sum)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(np.asarray(scale, np.float64)), 1e-30))


def router_config(e, k, score_func, pre_softmax, norm_topk, groups, group_topk, scaling, use_bias):
    """The MoEConfig of a router test case (d_model / d_ff do not matter to the router)."""
    return MoEConfig(d_model=8,
                     d_ff=8,
                     num_experts=e,
                     top_k=k,
                     score_func=score_func,
                     pre_softmax=pre_softmax,
                     norm_topk=norm_topk,
                     num_expert_groups=groups,
                     group_topk=group_topk,
                     routed_scaling_factor=scaling,
                     use_expert_bias=use_bias)
