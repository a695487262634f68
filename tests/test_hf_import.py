"""Hugging Face checkpoint import (experiments.import_hf) against transformers' own outputs.

The fixtures (tests/fixtures/hf/<arch>/, written by tests/fixtures/make_hf_fixtures.py with
transformers) hold tiny random Mixtral, Qwen3-MoE and OLMoE models and transformers' float32
logits, greedy continuation and router choices. Each is imported and run by the project's code
(no torch): logits within 1e-4 relative to the largest logit of the row on every position
(float32 through a few layers: the two implementations round differently, ~1e-6), the 16 greedy
tokens identical and every layer's top-k experts identical. Where torch and transformers are
importable a fresh random model is also built and compared directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")

from praxis import base_layer, pax_fiddle  # noqa: E402

from configs import stack  # noqa: E402
from experiments import import_hf, sample  # noqa: E402
from experiments.hf.checkpoint import HfImportError  # noqa: E402
from moe_praxis import routing  # noqa: E402
from moe_praxis.praxis import fields  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ARCHS = ("mixtral", "qwen3_moe", "olmoe")
RTOL = 1e-4


def _apply(sampler, ids, **kw):
    ctx = base_layer.JaxContext.HParams(do_eval=True)
    with base_layer.JaxContext.new_context(hparams=ctx):
        return sampler.model.apply(sampler.variables, ids, jnp.zeros(ids.shape, jnp.float32), **kw)


def router_choices(sampler, ids) -> list:
    """Each MoE layer's top-k expert ids [B*S, k] (sorted), from the layer's own normalised
    input (captured in the forward pass) through moe_praxis.routing.route with its config."""
    out, state = _apply(sampler,
                        ids,
                        capture_intermediates=lambda m, _: m.name == "layer_norm" and getattr(
                            m.parent, "name", None) == "ff_layer",
                        mutable=["intermediates"])
    found = state["intermediates"]["transformer"]
    params = sampler.variables[base_layer.PARAMS]["transformer"]
    configs = dict(stack.moe_layer_configs(sampler.prep.model_config))
    chosen = []
    for l in sorted(configs):
        x = found[f"x_layers_{l}"]["ff_layer"]["layer_norm"]["__call__"][0]
        w = params[f"x_layers_{l}"]["ff_layer"]["router"]
        config = fields.build_config(pax_fiddle.build(configs[l]))
        ids_l = routing.route(x.reshape(-1, x.shape[-1]), w, config).expert_ids
        chosen.append(np.sort(np.asarray(ids_l), axis=-1))
    return chosen


def check_against(job: Path, ref: dict) -> None:
    # transformers' float32 logits are the reference: float32 matrix products in float32 (on a
    # GPU JAX's default precision multiplies them in TF32, about 1e-3 relative).
    with jax.default_matmul_precision("highest"):
        _check_against(job, ref)


def _check_against(job: Path, ref: dict) -> None:
    sampler = sample.load_sampler(job)
    ids = jnp.asarray(ref["prompts"])
    logits = np.asarray(_apply(sampler, ids).logits, np.float32)
    want = ref["logits"]
    assert logits.shape == want.shape
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = np.abs(logits - want) / scale
    assert err.max() <= RTOL, f"max relative logit error {err.max():.2e}"
    for l, got in enumerate(router_choices(sampler, ids)):
        np.testing.assert_array_equal(got, ref[f"router_{l}"], err_msg=f"layer {l} routes")
    out = sampler.sample(ref["prompts"].tolist(),
                         max_new_tokens=ref["greedy"].shape[1],
                         temperature=0.0)
    got = np.array([t for t in out.tokens])
    np.testing.assert_array_equal(got, ref["greedy"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_matches_transformers(arch, tmp_path):
    job = import_hf.import_checkpoint(FIXTURES / arch, tmp_path / "job")
    ref = dict(np.load(FIXTURES / arch / "reference.npz"))
    check_against(job, ref)


def _copy(arch, tmp_path) -> Path:
    d = tmp_path / arch
    shutil.copytree(FIXTURES / arch, d)
    return d


def _edit_config(d: Path, **fields_) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields_)
    (d / "config.json").write_text(json.dumps(cfg))


def _refused(d: Path, tmp_path, match: str, **kw):
    out = tmp_path / "out"
    with pytest.raises(HfImportError, match=match) as e:
        import_hf.import_checkpoint(d, out, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".import." in p.name]
    return str(e.value)


def test_unsupported_architecture(tmp_path):
    d = _copy("olmoe", tmp_path)
    _edit_config(d, model_type="deepseek_v3")
    msg = _refused(d, tmp_path, "model_type='deepseek_v3' is not a supported architecture")
    assert str(d / "config.json") in msg
    d2 = _copy("mixtral", tmp_path)
    _refused(d2, tmp_path, "model_type='mixtral' but --arch='olmoe'", arch="olmoe")


@pytest.mark.parametrize("field,value,arch", [
    ("sliding_window", 16, "mixtral"),
    ("use_sliding_window", True, "qwen3_moe"),
    ("attention_bias", True, "qwen3_moe"),
    ("clip_qkv", 8.0, "olmoe"),
    ("kv_lora_rank", 512, "mixtral"),
    ("mlp_only_layers", [0], "qwen3_moe"),
    ("rope_parameters", {
        "rope_theta": 1e6,
        "rope_type": "yarn"
    }, "mixtral"),
])
def test_unimplemented_field_used(tmp_path, field, value, arch):
    d = _copy(arch, tmp_path)
    _edit_config(d, **{field: value})
    if field == "use_sliding_window":
        _edit_config(d, sliding_window=16)
        field = "sliding_window"
    shown = "rope_type='yarn'" if field == "rope_parameters" else field
    msg = _refused(d, tmp_path, "is not implemented by this port")
    assert shown in msg and str(d / "config.json") in msg


def test_missing_shard(tmp_path):
    d = _copy("mixtral", tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    _refused(
        d, tmp_path, r"model-00002-of-00003.safetensors does not exist: "
        r".*model.safetensors.index.json lists it for \d+ tensors")


def _rewrite(d: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    f = d / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor(tmp_path):
    d = _copy("qwen3_moe", tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    _refused(
        d, tmp_path, r"model.safetensors lacks tensor 'model.layers.1.mlp.experts.3."
        r"up_proj.weight' \(shape \[32, 64\]\)")


def test_wrong_shape(tmp_path):
    d = _copy("olmoe", tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.k_norm.weight"] = t[
            "model.layers.0.self_attn.k_norm.weight"][:16]

    _rewrite(d, edit)
    _refused(
        d, tmp_path, r"tensor 'model.layers.0.self_attn.k_norm.weight' has shape \[16\]; "
        r"config.json makes it \[32\]")


def test_unknown_tensor(tmp_path):
    d = _copy("olmoe", tmp_path)
    _rewrite(
        d, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": t["model.norm.weight"]}))
    _refused(d, tmp_path, "'model.layers.0.mlp.shared_expert.weight' .* is not part of")


def test_existing_job_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(HfImportError, match="exists and is not empty"):
        import_hf.import_checkpoint(FIXTURES / "olmoe", out)


@pytest.mark.slow
def test_fresh_transformers_model(tmp_path):
    """A new random model built by transformers here (not the committed fixture)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import make_hf_fixtures as mk

    tok = mk.train_tokenizer()
    model = mk.build_model("qwen3_moe", tok.get_vocab_size(), seed=7, norm_topk_prob=False)
    d = tmp_path / "model"
    mk.save(model, d, tok, shard_size="300KB")
    job = import_hf.import_checkpoint(d, tmp_path / "job")
    check_against(job, mk.reference(model, mk.prompt_batch(tok)))


@pytest.mark.slow
def test_expert_parallel_import(tmp_path):
    """Imported onto a data x expert mesh (ep 4, 16 experts): each device holds exactly its EP
    rank's 4 experts of the checkpoint, and the model continues the prompts as transformers
    does."""
    from safetensors.numpy import load_file

    mesh = dict(shape=(2, 4), axis_names=("data", "expert"), ep="expert")
    job = import_hf.import_checkpoint(FIXTURES / "olmoe", tmp_path / "job", mesh=mesh)
    ref = dict(np.load(FIXTURES / "olmoe" / "reference.npz"))
    sampler = sample.load_sampler(job)
    hf = load_file(str(FIXTURES / "olmoe" / "model.safetensors"))
    wi_gate = sampler.variables[
        base_layer.PARAMS]["transformer"]["x_layers_1"]["ff_layer"]["wi_gate"]
    want = np.stack([
        hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].astype(np.float32).T
        for e in range(16)
    ])
    for shard in wi_gate.addressable_shards:
        experts = range(16)[shard.index[0]]
        rank = list(sampler.mesh.devices.flat).index(shard.device) % 4
        assert list(experts) == list(range(4 * rank, 4 * rank + 4))
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    out = sampler.sample(ref["prompts"].tolist(),
                         max_new_tokens=ref["greedy"].shape[1],
                         temperature=0.0)
    np.testing.assert_array_equal(np.array(out.tokens), ref["greedy"])


@pytest.mark.slow
def test_sample_eval_and_finetune_commands(tmp_path):
    """The imported job directory works with experiments.main's sample, eval and training
    (which resumes from the imported step 0)."""
    from tests.main_util import records, run_main

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text("def main(argv):\n    return 0\n" * (200 + i))
    job = import_hf.import_checkpoint(FIXTURES / "mixtral",
                                      tmp_path / "job",
                                      data_path=texts,
                                      seq_len=32,
                                      batch_size=8)
    p = run_main([
        "--mode=sample", f"--job_log_dir={job}", "--prompt=def main(", "--max_new_tokens=4",
        "--no_progress"
    ])
    assert "checkpoint step 0" in p.stdout
    p = run_main(["--mode=eval", f"--job_log_dir={job}", "--no_progress"])
    result = json.loads(p.stdout[p.stdout.index("\n{\n") + 1:])
    assert result["step"] == 0 and np.isfinite(result["heldout_loss"])
    run_main([
        f"--job_log_dir={job}", "--fdl.train.num_steps=2", "--fdl.train.eval_every=2",
        "--no_progress"
    ])
    steps = [r["step"] for r in records(job, "train")]
    assert steps and steps[0] == 1 and steps[-1] == 2
    assert sorted(int(d.name) for d in (job / "checkpoints").iterdir()) == [0, 2]


@pytest.mark.slow
def test_import_train_benchmark_tiny(tmp_path):
    """benchmarks/hf_import_train.py end to end at its --tiny widths (a scanned, rematerialised
    stack of Qwen3-MoE layers written without transformers): the import reads the folder it
    wrote and the train steps give finite losses. Speed is the GPU run's output, not tested."""
    from benchmarks import hf_import_train

    out = tmp_path / "bench.json"
    assert hf_import_train.main([
        "--tiny", "--work",
        str(tmp_path / "work"), "--layers", "2", "--steps", "2", "--batch", "8", "--seq", "16",
        "--dtype", "float32", "--out",
        str(out)
    ]) == 0
    record = json.loads(out.read_text())
    row = record["result"]
    assert row["layers"] == 2 and len(row["losses"]) == 2
    # the import's own setting by default: its checkpoint copied to the host without pinned memory
    assert row["pinned_host"] == "import" and row["pinned_host_transfer"] is False
    assert record["meta"]["orbax_checkpoint"]
    assert all(np.isfinite(row["losses"])) and row["tokens_per_s"] > 0
    # the host memory of every stage the import logs, after the folder's writing, in order
    assert list(row["host_peak_by_stage_gib"]) == [
        "write", "reading the shards", "placing the parameters", "making the train state",
        "writing the checkpoint", "done"
    ]
    assert all(0 < v <= row["host_peak_rss_gib"] + 0.01
               for v in row["host_peak_by_stage_gib"].values())
