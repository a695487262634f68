"""Hugging Face tensor names and layouts -> the Praxis model's parameter tree.

``plan(spec, shards, repeat)`` maps every tensor a Mixtral, Qwen3-MoE or OLMoE checkpoint holds
onto the parameters of ``configs.hf``'s model, and checks names and shapes from the shard
headers before any tensor is read; ``Plan.read`` then fills float32 numpy arrays of the
parameter tree's shapes, one shard at a time. Letters: M model dims, N query heads, K key/value
heads, D head dim, E experts, H expert hidden dims, V vocabulary, l layer, e expert.

| Hugging Face (torch Linear weights are [out, in]) | Praxis parameter |
|---|---|
| model.embed_tokens.weight [V, M] | embedding_lookup/emb_var [V, M]; tied: softmax/logits_ffn/linear/w [M, V] (transposed) |
| lm_head.weight [V, M] | softmax/logits_ffn/linear/w [M, V] (transposed; absent or ignored when tied) |
| model.norm.weight [M] | final_ln/scale |
| layers.l.input_layernorm.weight [M] | layer l: layer_norm/scale |
| layers.l.post_attention_layernorm.weight [M] | layer l: ff_layer/layer_norm/scale |
| layers.l.self_attn.q_proj.weight [N*D, M] | self_attention/query/w [M, N, D] |
| layers.l.self_attn.k_proj / v_proj.weight [K*D, M] | self_attention/key/w, value/w [M, K, D] |
| layers.l.self_attn.o_proj.weight [M, N*D] | self_attention/post/w [M, N, D] |
| layers.l.self_attn.q_norm / k_norm.weight [D] or [N*D] / [K*D] | self_attention/query_norm, key_norm/scale |
| layers.l.{mlp,block_sparse_moe}.gate.weight [E, M] | ff_layer/router [M, E] |
| ...experts.e.{gate_proj,w1}.weight [H, M] | ff_layer/wi_gate[e] [M, H] |
| ...experts.e.{up_proj,w3}.weight [H, M] | ff_layer/wi_up[e] [M, H] |
| ...experts.e.{down_proj,w2}.weight [M, H] | ff_layer/wo[e] [H, M] |
| ...experts.gate_up_proj [E, 2H, M] (transformers 5's stacked form) | wi_gate, wi_up (first H rows gate) |
| ...experts.down_proj [E, M, H] | wo |

Both layouts keep the rotary pairs (i, i + D/2) of ``rotate_half``, which Praxis's rotary
embedding rotates too, so the projections need no permutation. A scanned stack
(``repeat=True``) holds each parameter once with a leading layer axis.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from configs.hf import HfModel
from experiments.hf.checkpoint import INDEX, HfImportError, Shards

# Buffers some checkpoints hold that the model derives (the rotary frequencies from rope_theta).
DERIVED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Dest:
    path: tuple  # the parameter's path in the params tree
    index: tuple  # the slice of it this tensor fills (layer of a scanned stack, expert)
    fn: Callable[[np.ndarray], np.ndarray]  # HF layout -> Praxis layout


@dataclasses.dataclass(frozen=True)
class Source:
    shape: tuple  # the HF tensor's shape
    dests: tuple  # of Dest


def _t(x):
    return x.T


class _Layout:
    """Where layer ``l``'s parameters live: ``transformer/x_layers_l`` or, scanned, the one
    ``transformer/repeat/sub/x_layers_0`` with ``l`` as the leading index."""

    def __init__(self, repeat: bool):
        self.repeat = repeat

    def at(self, l: int, *rest, index=(), fn=_t) -> Dest:
        if self.repeat:
            return Dest(("transformer", "repeat", "sub", "x_layers_0", *rest), (l, *index), fn)
        return Dest(("transformer", f"x_layers_{l}", *rest), tuple(index), fn)


def _expert_names(spec: HfModel, l: int) -> tuple[str, dict]:
    """(the MoE block's prefix, {praxis weight: HF projection name}) of layer l."""
    if spec.arch == "mixtral":
        return f"model.layers.{l}.block_sparse_moe", {"wi_gate": "w1", "wi_up": "w3", "wo": "w2"}
    return f"model.layers.{l}.mlp", {"wi_gate": "gate_proj", "wi_up": "up_proj", "wo": "down_proj"}


def expected(spec: HfModel, repeat: bool, names) -> dict[str, Source]:
    """{HF tensor name: Source} of every tensor the checkpoint must hold. ``names``: the names
    it holds, which choose per layer between the per-expert and the stacked expert layout."""
    m, n, k, d = spec.model_dims, spec.num_heads, spec.num_kv_heads, spec.head_dim
    e, h, v = spec.num_experts, spec.moe_hidden_dims, spec.vocab_size
    lay = _Layout(repeat)
    out = {
        "model.norm.weight": Source((m, ), (Dest(("final_ln", "scale"), (), lambda x: x), )),
    }
    if spec.tie_embeddings:
        out["model.embed_tokens.weight"] = Source((v, m), (Dest(
            ("softmax", "logits_ffn", "linear", "w"), (), _t), ))
    else:
        out["model.embed_tokens.weight"] = Source((v, m), (Dest(("embedding_lookup", "emb_var"),
                                                                (), lambda x: x), ))
        out["lm_head.weight"] = Source((v, m), (Dest(("softmax", "logits_ffn", "linear", "w"),
                                                     (), _t), ))
    same = lambda x: x  # noqa: E731
    for l in range(spec.num_layers):
        p = f"model.layers.{l}"
        att = ("self_attention", )
        out[f"{p}.input_layernorm.weight"] = Source((m, ),
                                                    (lay.at(l, "layer_norm", "scale", fn=same), ))
        out[f"{p}.post_attention_layernorm.weight"] = Source(
            (m, ), (lay.at(l, "ff_layer", "layer_norm", "scale", fn=same), ))
        for proj, heads in (("q", n), ("k", k), ("v", k)):
            child = {"q": "query", "k": "key", "v": "value"}[proj]
            out[f"{p}.self_attn.{proj}_proj.weight"] = Source(
                (heads * d, m),
                (lay.at(l, *att, child, "w", fn=lambda x, hh=heads: x.T.reshape(m, hh, d)), ))
        out[f"{p}.self_attn.o_proj.weight"] = Source(
            (m, n * d), (lay.at(l, *att, "post", "w", fn=lambda x: x.reshape(m, n, d)), ))
        if spec.qk_norm is not None:
            per_head = spec.qk_norm == "per_head"
            for proj, heads in (("q", n), ("k", k)):
                child = {"q": "query_norm", "k": "key_norm"}[proj]
                out[f"{p}.self_attn.{proj}_norm.weight"] = Source(
                    (d if per_head else heads * d, ), (lay.at(l, *att, child, "scale", fn=same), ))
        moe, proj_names = _expert_names(spec, l)
        out[f"{moe}.gate.weight"] = Source((e, m), (lay.at(l, "ff_layer", "router"), ))
        if f"{moe}.experts.gate_up_proj" in names:
            out[f"{moe}.experts.gate_up_proj"] = Source(
                (e, 2 * h, m),
                (lay.at(l, "ff_layer", "wi_gate", fn=lambda x: x[:, :h].transpose(0, 2, 1)),
                 lay.at(l, "ff_layer", "wi_up", fn=lambda x: x[:, h:].transpose(0, 2, 1))))
            out[f"{moe}.experts.down_proj"] = Source(
                (e, m, h), (lay.at(l, "ff_layer", "wo", fn=lambda x: x.transpose(0, 2, 1)), ))
            continue
        for i in range(e):
            for ours, theirs in proj_names.items():
                shape = (m, h) if ours == "wo" else (h, m)
                out[f"{moe}.experts.{i}.{theirs}.weight"] = Source(
                    shape, (lay.at(l, "ff_layer", ours, index=(i, )), ))
    return out


def _where(shards: Shards) -> str:
    return str(shards.model_dir /
               INDEX) if len(shards.files) > 1 or (shards.model_dir / INDEX).is_file() else str(
                   shards.files[0])


@dataclasses.dataclass
class Plan:
    """The tensors to read and where each goes (``plan``)."""
    sources: dict  # HF name -> Source
    ignored: tuple  # HF names read past: derived buffers, a tied checkpoint's lm_head

    def check_params(self, abstract_params) -> None:
        """Every parameter of the model (a tree of ShapeDtypeStruct) is filled by some tensor,
        and every destination exists with a fitting shape."""
        leaves = {
            tuple(getattr(k, "key", getattr(k, "name", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
        }
        dests = {d.path for s in self.sources.values() for d in s.dests}
        unfilled = sorted("/".join(p) for p in set(leaves) - dests)
        if unfilled:
            raise HfImportError(f"the model has parameters no checkpoint tensor fills: "
                                f"{', '.join(unfilled[:4])}; this port does not map them")
        unknown = sorted("/".join(p) for p in dests - set(leaves))
        if unknown:
            raise HfImportError(f"this port maps tensors onto parameters the model lacks: "
                                f"{', '.join(unknown[:4])}")
        self.shapes = {p: tuple(leaf.shape) for p, leaf in leaves.items()}

    def read(self, shards: Shards, *, progress: bool = True) -> dict:
        """{path: float32 array} of every parameter, the tensors read one shard at a time."""
        out = {p: np.zeros(s, np.float32) for p, s in self.shapes.items()}
        filled = {p: 0 for p in self.shapes}
        bar = tqdm(total=len(shards.headers), unit="tensor", desc="import", disable=not progress)
        for path, name, x in shards.tensors():
            bar.set_postfix_str(path.name, refresh=False)
            bar.update(1)
            if name in self.ignored:
                continue
            x = np.asarray(x, np.float32)
            for d in self.sources[name].dests:
                y = d.fn(x)
                want = self.shapes[d.path][len(d.index):]
                if y.shape != want:
                    raise HfImportError(f"{path}: tensor {name!r} converts to shape {y.shape}, "
                                        f"the parameter {'/'.join(d.path)} needs {want}")
                out[d.path][d.index] = y
                filled[d.path] += y.size
        bar.close()
        short = [p for p, n in filled.items() if n != out[p].size]
        if short:  # the plan covers every parameter, so this is a port bug, never bad input
            raise HfImportError(f"parameters {', '.join('/'.join(p) for p in short[:4])} were "
                                "not completely filled")
        return out


def plan(spec: HfModel, shards: Shards, *, repeat: bool = False) -> Plan:
    """The Plan of a checkpoint; HfImportError (one line naming the file and the tensor) for a
    missing tensor, one of the wrong shape, or one this port does not know."""
    names = set(shards.headers)
    sources = expected(spec, repeat, names)
    for name, src in sources.items():
        got = shards.shape(name)
        if got is None:
            raise HfImportError(f"{_where(shards)} lacks tensor {name!r} (shape "
                                f"{list(src.shape)}), which a {spec.arch} checkpoint of this "
                                "config.json holds")
        if got != src.shape:
            raise HfImportError(f"{shards.headers[name][0]}: tensor {name!r} has shape "
                                f"{list(got)}; config.json makes it {list(src.shape)}")
    ignored = []
    for name in sorted(names - set(sources)):
        if DERIVED.match(name) or (name == "lm_head.weight" and spec.tie_embeddings):
            ignored.append(name)
            continue
        raise HfImportError(f"{shards.headers[name][0]}: tensor {name!r} "
                            f"{list(shards.shape(name))} is not part of a {spec.arch} model of "
                            "this config.json; this port does not import it")
    return Plan(sources, tuple(ignored))


def param_tree(flat: dict) -> dict:
    """{path tuple: array} -> the nested params dict."""
    tree: dict = {}
    for path, x in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = x
    return tree
