"""Reading a Hugging Face model folder: ``config.json`` -> ``configs.hf.HfModel``, and the
safetensors shards' tensors, one shard at a time.

A folder holds ``config.json``, the weights as ``model.safetensors`` or as shards listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file), and
``tokenizer.json``. Everything that can be checked before reading a tensor is: the
architecture and every config field this port does not implement that the checkpoint uses
(``read_config``), and every shard's header (``Shards``: names, shapes, dtypes) against the
tensors the model needs (``experiments.hf.convert``). Each problem is an ``HfImportError`` of
one line naming the file and the value.

Tensors are read with ``safetensors.safe_open(..., framework='numpy')`` (bfloat16 through
ml_dtypes), one shard open at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from configs.hf import ARCHS, HfModel

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"


class HfImportError(ValueError):
    """A model folder this port cannot import (one line, exit status 2)."""


def _require_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError as e:
        raise HfImportError("reading Hugging Face checkpoints needs the safetensors package "
                            "(pip install safetensors, as setup.cfg pins it)") from e
    from safetensors import safe_open
    return safe_open


def _load_json(path: Path) -> dict:
    if not path.is_file():
        raise HfImportError(f"{path} does not exist: a Hugging Face model folder holds "
                            f"{CONFIG}, {SINGLE} (or {INDEX} and its shards) and {TOKENIZER}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HfImportError(f"{path} does not read as JSON ({type(e).__name__}: {e})") from e


def _rope_theta(cfg: dict, where: Path) -> float:
    """The rotary base; a rope scaling other than the default is refused."""
    params = cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", kind))
    if kind not in (None, "default"):
        raise HfImportError(f"{where}: rope_type={kind!r} (rotary scaling) is not implemented by "
                            "this port; valid: 'default'")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise HfImportError(f"{where}: rope_theta={theta!r} is invalid: a positive number")
    return float(theta)


def _refuse_used(cfg: dict, where: Path, arch: str) -> None:
    """Config fields this port does not implement, refused where the checkpoint uses them."""
    max_pos = cfg.get("max_position_embeddings") or float("inf")
    window = cfg.get("sliding_window")
    uses_window = (cfg.get("use_sliding_window", True) and window is not None and window < max_pos)
    checks = [
        ("hidden_act", cfg.get("hidden_act", "silu"), lambda v: v == "silu", "'silu'"),
        ("attention_bias", cfg.get("attention_bias", False), lambda v: not v, "false"),
        ("attention_dropout", cfg.get("attention_dropout", 0.0), lambda v: not v, "0"),
        ("sliding_window", window, lambda v: not uses_window,
         "null, or use_sliding_window false (sliding-window attention is not implemented)"),
        ("router_jitter_noise", cfg.get("router_jitter_noise", 0.0), lambda v: not v, "0"),
        ("clip_qkv", cfg.get("clip_qkv"), lambda v: v is None, "null"),
        ("q_lora_rank", cfg.get("q_lora_rank"), lambda v: v is None,
         "absent (multi-head latent attention is not implemented)"),
        ("kv_lora_rank", cfg.get("kv_lora_rank"), lambda v: v is None,
         "absent (multi-head latent attention is not implemented)"),
    ]
    if arch == "qwen3_moe":
        checks += [
            ("decoder_sparse_step", cfg.get("decoder_sparse_step",
                                            1), lambda v: v == 1, "1 (every layer MoE)"),
            ("mlp_only_layers", cfg.get("mlp_only_layers",
                                        []), lambda v: not v, "[] (every layer MoE)"),
        ]
    for field, value, ok, valid in checks:
        if not ok(value):
            raise HfImportError(f"{where}: {field}={value!r} is not implemented by this port; "
                                f"valid: {valid}")


def _int(cfg: dict, where: Path, *names) -> int:
    for name in names:
        v = cfg.get(name)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HfImportError(f"{where}: {name}={v!r} is invalid: a positive int")
            return v
    raise HfImportError(f"{where} lacks {' or '.join(names)}")


def read_config(model_dir, arch: str = "auto") -> HfModel:
    """The ``HfModel`` of ``model_dir/config.json``. ``arch``: 'auto' (its ``model_type``) or
    one of ``configs.hf.ARCHS``, which must be the folder's."""
    where = Path(model_dir) / CONFIG
    cfg = _load_json(where)
    model_type = cfg.get("model_type")
    if model_type not in ARCHS:
        raise HfImportError(f"{where}: model_type={model_type!r} is not a supported "
                            f"architecture; valid: {', '.join(ARCHS)}")
    if arch not in ("auto", *ARCHS):
        raise HfImportError(f"--arch={arch!r} is invalid; valid: auto, {', '.join(ARCHS)}")
    if arch != "auto" and arch != model_type:
        raise HfImportError(f"{where}: model_type={model_type!r} but --arch={arch!r}; give "
                            f"--arch=auto or --arch={model_type}")
    _refuse_used(cfg, where, model_type)
    m = _int(cfg, where, "hidden_size")
    heads = _int(cfg, where, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or heads % kv:
        raise HfImportError(f"{where}: num_key_value_heads={kv!r} is invalid: a divisor of "
                            f"num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or m // heads
    hidden = _int(
        cfg, where,
        *(("moe_intermediate_size", ) if model_type == "qwen3_moe" else ("intermediate_size", )))
    experts = _int(cfg, where, "num_local_experts", "num_experts")
    top_k = _int(cfg, where, "num_experts_per_tok")
    if top_k > experts:
        raise HfImportError(f"{where}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    norm_topk = True if model_type == "mixtral" else cfg.get("norm_topk_prob", False)
    eps = cfg.get("rms_norm_eps", 1e-6)
    return HfModel(arch=model_type,
                   vocab_size=_int(cfg, where, "vocab_size"),
                   model_dims=m,
                   num_layers=_int(cfg, where, "num_hidden_layers"),
                   num_heads=heads,
                   num_kv_heads=kv,
                   head_dim=head_dim,
                   num_experts=experts,
                   top_k=top_k,
                   moe_hidden_dims=hidden,
                   norm_topk=bool(norm_topk),
                   rope_theta=_rope_theta(cfg, where),
                   norm_epsilon=float(eps),
                   qk_norm={
                       "mixtral": None,
                       "qwen3_moe": "per_head",
                       "olmoe": "full"
                   }[model_type],
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
                   z_loss_coeff=float(cfg.get("router_z_loss_coef", 0.0) or 0.0))


class Shards:
    """The safetensors files of a model folder and the tensors each holds (from the headers:
    nothing is read until ``tensors``)."""

    def __init__(self, model_dir):
        self.model_dir = Path(model_dir)
        safe_open = _require_safetensors()
        index, single = self.model_dir / INDEX, self.model_dir / SINGLE
        if index.is_file():
            weight_map = _load_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HfImportError(f"{index} has no weight_map (tensor name -> shard file)")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.model_dir / f).is_file():
                    n = sum(1 for v in weight_map.values() if v == f)
                    raise HfImportError(f"{self.model_dir / f} does not exist: {index} lists it "
                                        f"for {n} tensors; restore the shard")
        elif single.is_file():
            files, weight_map = [SINGLE], None
        else:
            raise HfImportError(f"{self.model_dir} holds neither {SINGLE} nor {INDEX}: no "
                                "weights to import")
        self.files = [self.model_dir / f for f in files]
        self.headers: dict[str, tuple[Path, tuple, str]] = {}  # name -> (file, shape, dtype)
        for path in self.files:
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        self.headers[name] = (path, tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise HfImportError(f"{path} is not a readable safetensors file "
                                    f"({type(e).__name__}: {e})") from e
        if weight_map is not None:
            for name, f in weight_map.items():
                got = self.headers.get(name)
                if got is None or got[0].name != Path(f).name:
                    raise HfImportError(f"{self.model_dir / f} lacks tensor {name!r}, which "
                                        f"{index} places there")

    def shape(self, name: str) -> Optional[tuple]:
        got = self.headers.get(name)
        return None if got is None else got[1]

    def tensors(self) -> Iterator[tuple[Path, str, np.ndarray]]:
        """(file, name, array) of every tensor, one shard file open at a time."""
        safe_open = _require_safetensors()
        for path in self.files:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    yield path, name, f.get_tensor(name)
