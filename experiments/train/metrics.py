"""What a run writes and reads back: metrics.jsonl, TensorBoard events, the summary plot, and
the expert load and router statistics gathered from the MoE layers' summaries."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

_LOAD_RE = re.compile(r"moe_expert_load_(\d+)_scalar$")
_LAYER_RE = re.compile(r"x_layers_(\d+)$")
_ENTROPY_SUMMARY = "moe_router_entropy"
# The MoE layers' scalar summaries (MoEFeedForward._add_summaries) -> train metric names.
MOE_SCALARS = {
    _ENTROPY_SUMMARY: "router_entropy",
    "moe_dropped_token_fraction": "dropped_token_fraction",
    "moe_z_loss": "z_loss",
}
# The expert-load image in TensorBoard: each cell a block of pixels, the image at least
# IMAGE_MIN_PX on its short side where that keeps the long side within IMAGE_MAX_PX.
IMAGE_MIN_PX, IMAGE_MAX_PX = 256, 1024


def _flat_summaries(tree, prefix=()):
    if isinstance(tree, dict) or hasattr(tree, "items"):
        for k, v in tree.items():
            yield from _flat_summaries(v, prefix + (str(k), ))
    else:
        yield prefix, tree


def _by_layer(summaries, column, num_layers: int, layers_per_block: int,
              first_repeated: int) -> dict:
    """{(layer, col): value} of the summaries whose name ``column(name)`` maps to a column
    (None: not wanted), placed by ``expert_load``'s rule for the stacked and repeated stacks."""
    found = {}
    for path, v in _flat_summaries(summaries):
        col = column(path[-1])
        if col is None:
            continue
        inner = next((int(_LAYER_RE.match(p).group(1)) for p in path if _LAYER_RE.match(p)), 0)
        vals = jnp.asarray(v, jnp.float32).reshape(-1)
        if vals.shape[0] == 1:
            found[(inner, col)] = vals[0]
        else:
            for r in range(vals.shape[0]):
                found[(first_repeated + r * layers_per_block + inner, col)] = vals[r]
    return {k: v for k, v in found.items() if k[0] < num_layers}


def expert_load(summaries, num_layers: int, layers_per_block: int = 1, first_repeated: int = 0):
    """[num_layers, E] fraction of routed token copies per expert, from the layers'
    ``moe_expert_load_{e}`` summaries (rows of dense layers are NaN); None if there are none.

    StackedTransformer: layer l's summaries sit under ``x_layers_{l}``. The repeated stack
    stacks its block's summaries along a leading repeat dimension: layer = first_repeated +
    repeat index * layers_per_block + the index inside the block (first_repeated: the dense
    layers of a DenseFirstRepeated before its repeats, which hold no MoE layer)."""

    def column(name):
        m = _LOAD_RE.search(name)
        return int(m.group(1)) if m else None

    found = _by_layer(summaries, column, num_layers, layers_per_block, first_repeated)
    if not found:
        return None
    num_e = max(e for _, e in found) + 1
    rows = [[found.get((li, e), jnp.float32(jnp.nan)) for e in range(num_e)]
            for li in range(num_layers)]
    return jnp.asarray(rows, jnp.float32)


def router_entropy_by_layer(summaries,
                            num_layers: int,
                            layers_per_block: int = 1,
                            first_repeated: int = 0):
    """[num_layers] each MoE layer's router entropy (its ``moe_router_entropy`` summary: the
    mean over tokens of the entropy of softmax(logits), nats; NaN for a dense layer), placed
    as ``expert_load`` places the loads; None without MoE layers. ``router_entropy`` in the
    metrics is their mean; this says which layer's router has settled (near 0: each token
    goes to one expert)."""
    name = f"{_ENTROPY_SUMMARY}_scalar"
    found = _by_layer(summaries, lambda n: 0
                      if n == name else None, num_layers, layers_per_block, first_repeated)
    if not found:
        return None
    return jnp.asarray([found.get((li, 0), jnp.float32(jnp.nan)) for li in range(num_layers)],
                       jnp.float32)


def max_mean_load(load):
    """[num_layers] max over experts / mean over experts of each layer's load (``expert_load``'s
    rows): 1 = balanced, E = every copy on one expert; NaN for a dense layer. DeepSeek-V3's
    expert bias drives it towards 1."""
    return jnp.max(load, axis=1) / jnp.mean(load, axis=1)


def layer_scalars(name: str, per_layer) -> dict:
    """{f'{name}_layer_{l}': value} for the layers whose value is finite (the MoE layers)."""
    return {
        f"{name}_layer_{l}": float(v)
        for l, v in enumerate(np.asarray(per_layer)) if np.isfinite(v)
    }


def moe_scalars(summaries) -> dict:
    """{metric name: mean over every MoE layer} of the layers' router entropy, fraction of
    dropped token copies and z-loss summaries (``MOE_SCALARS``); {} without MoE layers. The
    repeated stack's summaries carry a leading repeat dimension; the mean is over it too."""
    found = {}
    for path, v in _flat_summaries(summaries):
        for summary, metric in MOE_SCALARS.items():
            if path[-1] == f"{summary}_scalar":
                found.setdefault(metric, []).append(jnp.asarray(v, jnp.float32).reshape(-1))
    return {k: jnp.mean(jnp.concatenate(vs)) for k, vs in found.items()}


def upscale(img: np.ndarray) -> np.ndarray:
    """[H, W] -> [H*f, W*f], each value a block of f x f pixels (nearest neighbour): the
    largest f <= ceil(IMAGE_MIN_PX / min(H, W)) that keeps the long side within IMAGE_MAX_PX
    (at least 1), so a layers x experts matrix of a few cells is readable in TensorBoard."""
    h, w = img.shape
    f = max(1, min(math.ceil(IMAGE_MIN_PX / min(h, w)), IMAGE_MAX_PX // max(h, w)))
    return np.repeat(np.repeat(img, f, axis=0), f, axis=1)


class MetricsWriter:
    """metrics.jsonl + TensorBoard events, written by process 0 only."""

    def __init__(self, job_log_dir: Path, enabled: bool):
        self.enabled = enabled
        self.path = job_log_dir / "metrics.jsonl"
        self.tb_dir = job_log_dir / "tensorboard"
        self._file = None
        self._tb = None
        if enabled:
            job_log_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), "time": time.time()}
        for k, v in values.items():
            v = np.asarray(v)
            rec[k] = v.tolist() if v.ndim else float(v)
            if v.ndim == 0:
                self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
            elif v.ndim == 2:  # the [layers, experts] load as a grey image (white = max)
                img = upscale(np.nan_to_num(v.astype(np.float32)))
                self._tb.add_image(f"{kind}/{k}",
                                   img / max(float(img.max()), 1e-9),
                                   int(step),
                                   dataformats="HW")
        self._file.write(json.dumps(rec) + "\n")

    def close(self):
        if self.enabled:
            self._file.close()
            self._tb.flush()
            self._tb.close()


def read_metrics(path) -> list[dict]:
    """metrics.jsonl records, keeping the LAST record of each (kind, step) (a restarted run may
    repeat steps done after its last checkpoint), sorted by step."""
    latest = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                latest[(rec["kind"], rec["step"])] = rec
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"]))


def plot_summary(metrics_path, png_path, title: str = "") -> Path:
    """Loss curves (train xent, held-out loss) and the expert-load heatmap (layers x experts,
    fraction of routed token copies, latest record) from metrics.jsonl, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    loads = [r for r in recs if r["kind"] == "expert_load"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["xent"] for r in train],
                lw=0.8,
                label="train cross-entropy")
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_loss"] for r in ev],
                "o-",
                label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(f"{title} loss".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    bpb = [r for r in ev if "heldout_bits_per_byte" in r]
    if bpb:  # bits per byte compares across tokenizers
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in bpb], [r["heldout_bits_per_byte"] for r in bpb],
                 "s--",
                 color="tab:green",
                 label="held-out bits per byte")
        ax2.set_ylabel("bits / byte")
        ax2.legend(loc="center right")
    ax = axes[1]
    if loads:
        mat = np.array(loads[-1]["load"], dtype=float)
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
        if mat.shape[0] <= 64:
            ax.set_yticks(range(mat.shape[0]))
        if mat.shape[1] <= 32:
            ax.set_xticks(range(mat.shape[1]))
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title(f"expert load at step {loads[-1]['step']} (fraction of routed tokens)")
        fig.colorbar(im, ax=ax)
    else:
        ax.text(0.5, 0.5, "no expert-load summaries", ha="center", va="center")
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)
