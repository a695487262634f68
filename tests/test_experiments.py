"""Experiments: registry, flags and config errors (before any compilation), data, metrics and
plot, and the docs kept in step with the code. In-process and fast; the end-to-end runs are in
test_experiments_e2e.py."""

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from absl import flags

from configs import base, experiments, registry
from experiments import data as data_lib
from experiments import main as main_lib
from experiments import metrics, setup, steps
from tests.flagutil import parse, reset_flags  # noqa: F401  (reset_flags: autouse)

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("name", [
    "configs.experiments.TinySynthetic", "experiments.TinySynthetic", "TinySynthetic",
    "tinysynthetic", "tiny_synthetic", "experiments.tiny_synthetic"
])
def test_registry_resolves_full_suffix_and_snake_names(name):
    assert registry.get_experiment(name) is experiments.TinySynthetic


def test_registry_snake_names():
    names = {registry.short_name(c) for c in registry.all_experiments().values()}
    assert {"tiny", "tiny_synthetic", "small_gpu", "mixtral8x7b", "deep_seek_v3"} <= names


@pytest.mark.parametrize("bad,expect", [("tiny_synthtic", "configs.experiments.TinySynthetic"),
                                        ("DeepSeekV4", "configs.experiments.DeepSeekV3"),
                                        ("mixtral", "configs.experiments.Mixtral8x7B")])
def test_bad_experiment_name_names_close_matches(bad, expect):
    with pytest.raises(LookupError) as e:
        registry.get_experiment(bad)
    msg = str(e.value)
    assert repr(bad) in msg and "did you mean" in msg and expect in msg.split("Registered")[0]


def test_bad_exp_flag_is_a_usage_error():
    parse("--exp=tinny")
    with pytest.raises(main_lib.UsageError, match=r"'tinny'.*did you mean .*Tiny"):
        main_lib.config_from_flags()


def test_knobs_reach_the_config():

    class Deeper(experiments.Tiny):
        NUM_LAYERS = 3
        NUM_EXPERTS = 4
        SEQ_LEN = 32
        LEARNING_RATE = 1e-3

    cfg = Deeper().experiment_config()
    assert cfg.model.stacked_transformer_tpl.num_layers == 3
    assert cfg.model.stacked_transformer_tpl.moe_layers == [0, 1, 2]
    assert cfg.model.stacked_transformer_tpl.num_experts == 4
    assert cfg.data.seq_len == 32 and cfg.optimizer.learning_rate == 1e-3
    assert cfg.name == "deeper"


# ------------------------------------------------------------------------------- flags


def test_default_is_tiny_and_overrides_apply():
    parse("--fdl.train.num_steps=7", "--fdl_set=data.seq_len=32",
          "--fdl.model.stacked_transformer_tpl.num_experts=4")
    cfg, name = main_lib.config_from_flags()
    assert name == "tiny"
    assert cfg.train.num_steps == 7 and cfg.data.seq_len == 32
    assert cfg.model.stacked_transformer_tpl.num_experts == 4


def test_fdl_config_and_fiddler():
    parse("--fdl_config=tiny", "--fiddler=use_synthetic_data", "--fdl.train.seed=3")
    cfg, _ = main_lib.config_from_flags()
    assert cfg.data.source == "synthetic" and cfg.train.seed == 3
    parse("--exp=tiny", "--fiddler=use_synthetic_data")
    cfg, _ = main_lib.config_from_flags()
    assert cfg.data.source == "synthetic"


def test_bad_fdl_config_names_close_matches():
    parse("--fdl_config=tiny_synthtic")
    with pytest.raises(main_lib.UsageError, match=r"tiny_synthtic.*Did you mean tiny_synthetic"):
        main_lib.config_from_flags()


def test_exp_and_fdl_config_are_exclusive():
    parse("--exp=tiny", "--fdl_config=tiny")
    with pytest.raises(main_lib.UsageError, match="mutually exclusive"):
        main_lib.config_from_flags()


@pytest.mark.parametrize("arg,pattern", [
    ("--fdl.trian.num_steps=3", r"'trian'.*did you mean train"),
    ("--fdl.train.num_stepz=3", r"train has no field 'num_stepz'; did you mean num_steps"),
    ("--fdl.model.stacked_transformer_tpl.num_layer=3",
     r"model.stacked_transformer_tpl has no field 'num_layer'; did you mean num_layers"),
    ("--fdl.train.num_steps=abc", r"train.num_steps=abc.*Could not parse"),
    ("--fdl.model.stacked_transformer_tpl.moe_layers[7]=1", r"moe_layers\[7\] does not exist"),
])
def test_bad_override_path_or_value(arg, pattern):
    parse(arg)
    with pytest.raises(main_lib.UsageError, match=pattern):
        main_lib.config_from_flags()


@pytest.mark.parametrize("arg,pattern", [
    ("--fdl.data.source='pdf'", r"DataConfig.source='pdf' is invalid: valid: \('pydoc'"),
    ("--fdl.data.source='text'", r"DataConfig.path=None is invalid: source='text' needs"),
    ("--fdl.optimizer.schedule='cosin'", r"schedule='cosin' is invalid"),
    ("--fdl.train.num_steps=0", r"TrainConfig.num_steps=0 is invalid"),
    ("--fdl.mesh.ep='expert'", r"MeshConfig.ep='expert' is invalid: axis 'expert' is not a "),
    ("--fdl.data.batch_size=12", r"batch_size=12 is not divisible by the 8 devices"),
    ("--fdl.model.stacked_transformer_tpl.moe_layers=[0, 5]", r"indices \[5\] outside"),
    ("--fdl.model.stacked_transformer_tpl.num_heads=3", r"model_dims=128 is not divisible by "),
    ("--fdl.model.vocab_size=100", r"vocab_size=100 is invalid: byte-level"),
])
def test_invalid_config_stops_before_compilation(arg, pattern, monkeypatch):
    # Any compilation would go through jax.jit(...).lower / compile: make it fail loudly.
    import jax

    def no_jit(*a, **k):
        raise AssertionError("compiled before validating")

    parse(arg)
    cfg, _ = main_lib.config_from_flags()
    monkeypatch.setattr(jax, "jit", no_jit)
    with pytest.raises(setup.ConfigError, match=pattern):
        setup.prepare(cfg)


def test_mesh_errors_come_from_ep_bootstrap():
    cfg = experiments.tiny()
    experiments.use_mesh(
        cfg,
        experiments.fdl.Config(base.MeshConfig,
                               shape=(2, 4),
                               axis_names=("data", "ex"),
                               dp="data",
                               ep="ex"))
    cfg.model.stacked_transformer_tpl.num_experts = 6
    with pytest.raises(setup.ConfigError, match=r"num_experts=6.*ep"):
        setup.prepare(cfg)
    cfg.mesh.shape = (3, 4)
    with pytest.raises(setup.ConfigError, match=r"needs 12 devices; this job has 8"):
        setup.prepare(cfg)


def test_expert_parallel_mesh_annotates_the_moe_layer():
    cfg = experiments.tiny()
    experiments.use_mesh(
        cfg,
        experiments.fdl.Config(base.MeshConfig,
                               shape=(2, 2, 2),
                               axis_names=("data", "fsdp", "ex"),
                               dp="data",
                               fsdp="fsdp",
                               ep="ex"))
    prep = setup.prepare(cfg)
    moe = prep.model_config.stacked_transformer_tpl.moe_layer_tpl
    assert moe.mesh_resources.ep == "ex" and moe.mesh_resources.fsdp == "fsdp"
    # ep before fsdp on the expert dimension (DESIGN.md), from ep_bootstrap's weight specs.
    assert list(moe.weight_split_dims_mapping.emh)[0] == ("ex", "fsdp")
    assert list(moe.weight_split_dims_mapping.ehm)[0] == ("ex", "fsdp")


MOE_TPL = "model.stacked_transformer_tpl.moe_layer_tpl"


def test_sharding_is_written_by_the_config_and_fdl_overrides_win():
    """The model's sharding is part of the experiment config (written before --fdl overrides):
    an override of a sharding field reaches the built model unchanged, and a mesh given by a
    fiddler is written with its roles."""
    emh = "[('fsdp', 'expert'), None, None]"
    parse("--fiddler=use_fsdp_expert_parallel(dp=2, fsdp=2, ep=2)",
          f"--fdl.{MOE_TPL}.weight_split_dims_mapping.emh={emh}",
          f"--fdl.{MOE_TPL}.weight_split_dims_mapping.me=[None, 'fsdp']")
    cfg, _ = main_lib.config_from_flags()
    moe_cfg = cfg.model.stacked_transformer_tpl.moe_layer_tpl
    assert moe_cfg.mesh_resources.ep == "expert" and moe_cfg.mesh_resources.fsdp == "fsdp"
    assert list(moe_cfg.weight_split_dims_mapping.ehm) == [("expert", "fsdp"), None, None]
    prep = setup.prepare(cfg)
    for moe in (prep.model_config.stacked_transformer_tpl.moe_layer_tpl,
                prep.model.stacked_transformer_tpl.moe_layer_tpl):
        assert list(moe.weight_split_dims_mapping.emh) == [("fsdp", "expert"), None, None]
        assert list(moe.weight_split_dims_mapping.me) == [None, "fsdp"]
        assert list(moe.weight_split_dims_mapping.ehm) == [("expert", "fsdp"), None, None]
    assert prep.layout.token_axes == ("data", "fsdp", "expert")


def test_mesh_override_after_the_sharding_was_written_is_refused():
    """A mesh changed by --fdl.mesh overrides (after the config wrote the model's sharding for
    its own mesh) is refused with the fix, instead of training with stale sharding."""
    parse("--fiddler=use_expert_parallel(ep=2)", "--fdl.mesh.shape=(2, 4)")
    cfg, _ = main_lib.config_from_flags()
    with pytest.raises(setup.ConfigError,
                       match=r"sharded for mesh axes \['data', 'expert'\] "
                       r"of shape \[-1, 2\].*use_mesh"):
        setup.prepare(cfg)
    parse("--fdl.mesh.shape=(4, 2)", "--fdl.mesh.axis_names=('data', 'expert')",
          "--fdl.mesh.ep='expert'")
    cfg, _ = main_lib.config_from_flags()
    with pytest.raises(setup.ConfigError, match=r"model carries no sharding.*use_mesh"):
        setup.prepare(cfg)
    parse("--fiddler=use_mesh(shape=(4, 2), axis_names=('data', 'expert'), ep='expert')")
    cfg, _ = main_lib.config_from_flags()
    prep = setup.prepare(cfg)
    assert prep.layout.ep_size == 2 and list(prep.model_config.ici_mesh_shape) == [4, 2]


# --------------------------------------------------------------------------------- data


def _cfg(**kw):
    return base.DataConfig(**{"seq_len": 16, "batch_size": 4, **kw})


def test_batches_are_a_function_of_seed_and_step():
    ds = data_lib.load_dataset(_cfg())
    a, b = ds.train_batch(5), ds.train_batch(5)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(ds.train_batch(5)["ids"], ds.train_batch(6)["ids"])
    other = data_lib.load_dataset(_cfg(seed=1))
    assert not np.array_equal(other.train_batch(5)["ids"], a["ids"])
    assert a["ids"].shape == (4, 16) and a["ids"].dtype == np.int32
    # labels are the next bytes
    np.testing.assert_array_equal(a["ids"][:, 1:], a["labels"][:, :-1])
    assert a["weights"].shape == (4, 16) and np.all(a["weights"] == 1)


def test_pydoc_split_is_a_disjoint_tail():
    ds = data_lib.load_dataset(_cfg(heldout_fraction=0.2))
    corpus = np.frombuffer(data_lib.pydoc_corpus(), np.uint8)
    assert len(ds.train) + len(ds.heldout) == len(corpus)
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.heldout]), corpus)
    assert abs(len(ds.heldout) / len(corpus) - 0.2) < 1e-3
    text = corpus.tobytes().decode()
    assert "for" in text and "statement" in text  # English prose about Python
    # every training window lies inside the train part
    rng = np.random.default_rng(0)
    for step in rng.integers(0, 10**6, 5):
        b = ds.train_batch(int(step))
        joined = ds.train.tobytes()
        for row in b["ids"]:
            assert bytes(row.astype(np.uint8)) in joined
    ev = ds.eval_batches(3)
    assert len(ev) == 3 and all(e["ids"].shape == (4, 16) for e in ev)
    held = ds.heldout.tobytes()
    assert all(bytes(r.astype(np.uint8)) in held for e in ev for r in e["ids"])


def test_text_file_and_directory(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_bytes(b"A" * 300)
    (tmp_path / "d" / "sub" / "b.txt").write_bytes(b"B" * 300)
    (tmp_path / "d" / ".hidden").write_bytes(b"H" * 300)
    (tmp_path / "d" / "sub" / "c.bin").write_bytes(b"C\0" * 300)  # binary: skipped
    ds = data_lib.load_dataset(_cfg(source="text", path=str(tmp_path / "d"), heldout_fraction=0.5))
    allb = ds.train.tobytes() + ds.heldout.tobytes()
    assert allb == b"A" * 300 + b"\n\n" + b"B" * 300
    (tmp_path / "f.txt").write_bytes(bytes(range(256)) * 2)
    ds = data_lib.load_dataset(_cfg(source="text", path=str(tmp_path / "f.txt")))
    assert len(ds.train) + len(ds.heldout) == 512
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        data_lib.load_dataset(_cfg(source="text", path=str(tmp_path / "nope")))
    (tmp_path / "small.txt").write_bytes(b"x" * 30)
    with pytest.raises(ValueError, match=r"leaves \d+ bytes in the held-out split"):
        data_lib.load_dataset(_cfg(source="text", path=str(tmp_path / "small.txt")))


def test_synthetic_source_is_deterministic_and_low_entropy():
    a = data_lib.synthetic_corpus(20000, seed=3)
    assert a == data_lib.synthetic_corpus(20000, seed=3)
    assert a != data_lib.synthetic_corpus(20000, seed=4)
    # Order-2 conditional entropy is at most log(4) (4 successors per context), far below
    # the unigram entropy: measured from the corpus itself.
    x = np.frombuffer(a, np.uint8).astype(np.int64)
    ctx = x[:-2] * 256 + x[1:-1]
    pairs = ctx * 256 + x[2:]
    _, pc = np.unique(pairs, return_counts=True)
    _, cc = np.unique(ctx, return_counts=True)
    h2 = -(np.sum(pc * np.log(pc)) - np.sum(cc * np.log(cc))) / len(pairs)
    _, uc = np.unique(x, return_counts=True)
    h0 = -np.sum(uc / len(x) * np.log(uc / len(x)))
    assert h2 < math.log(4) + 1e-6 and h0 > 3.5


# ------------------------------------------------------------------- metrics, load, plot


def test_expert_load_from_summaries_stacked_and_repeated():
    rng = np.random.default_rng(0)
    loads = rng.dirichlet(np.ones(4), size=3)  # [L=3, E=4]
    stacked = {
        "transformer": {
            f"x_layers_{l}": {
                "ff_layer": {
                    f"moe_expert_load_{e}_scalar": loads[l, e]
                    for e in range(4)
                } | {
                    "moe_aux_loss_scalar": 1.0
                }
            }
            for l in (0, 2)
        }
    }
    got = np.asarray(metrics.expert_load(stacked, 3))
    np.testing.assert_allclose(got[[0, 2]], loads[[0, 2]], rtol=1e-6)
    assert np.all(np.isnan(got[1]))  # a dense layer
    repeated = {
        "transformer": {
            "repeat": {
                "sub": {
                    "x_layers_0": {
                        "ff_layer": {
                            f"moe_expert_load_{e}_scalar": loads[:, e].reshape(3, 1)
                            for e in range(4)
                        }
                    }
                }
            }
        }
    }
    np.testing.assert_allclose(np.asarray(metrics.expert_load(repeated, 3)), loads, rtol=1e-6)
    assert metrics.expert_load({"a": {"b_scalar": 1.0}}, 2) is None
    # DenseFirstRepeated: 1 dense layer before the repeats
    got = np.asarray(metrics.expert_load(repeated, 4, 1, 1))
    np.testing.assert_allclose(got[1:], loads, rtol=1e-6)
    assert np.all(np.isnan(got[0]))
    mm = np.asarray(metrics.max_mean_load(metrics.expert_load(stacked, 3)))
    np.testing.assert_allclose(mm[[0, 2]], loads[[0, 2]].max(1) / loads[[0, 2]].mean(1), rtol=1e-6)
    assert np.isnan(mm[1])


@pytest.mark.parametrize("repeat", [False, True], ids=["stacked", "repeated"])
def test_first_k_dense_layers(repeat):
    """FIRST_K_DENSE=1 on a 3-layer Tiny: layer 0 has a dense FFN (no router), layers 1 and 2
    are MoE, unrolled (moe_layers=[1, 2]) or as 1 dense layer + 2 scanned MoE repeats
    (DenseFirstRepeated); a train step's expert load has a NaN row for the dense layer."""
    import jax

    from configs import models
    from moe_praxis.praxis.stack import DenseFirstRepeated

    class Dense1(experiments.Tiny):
        NUM_LAYERS, FIRST_K_DENSE, REPEAT = 3, 1, repeat
        BATCH_SIZE, SEQ_LEN = 8, 16
        USE_EXPERT_BIAS, EXPERT_BIAS_UPDATE_RATE = True, 0.5

    cfg = Dense1().experiment_config()
    st = cfg.model.stacked_transformer_tpl
    assert models.num_layers(cfg.model) == 3
    assert (st.__fn_or_cls__ is DenseFirstRepeated) == repeat
    prep = setup.prepare(cfg)
    fns = steps.make_step_fns(prep)
    params = fns.abstract_state["params"]["transformer"]
    if repeat:
        dense, moe = params["dense"]["x_layers_0"], params["repeat"]["sub"]["x_layers_0"]
        assert moe["ff_layer"]["router"].shape == (2, 128, 8)
        assert "dense" not in params["repeat"]["sub"]
    else:
        dense, moe = params["x_layers_0"], params["x_layers_1"]
        assert "router" in params["x_layers_2"]["ff_layer"]
    assert "router" not in dense["ff_layer"] and "router" in moe["ff_layer"]
    assert dense["ff_layer"]["ffn_layer1"]["linear"]["w"].shape == (128, 128)
    with jax.set_mesh(prep.mesh):
        state = fns.init(jax.random.key(0))
        new, m = fns.train(state, steps.put_batch(prep.dataset.train_batch(0), fns.batch_sharding))
    load = np.asarray(m["expert_load"])
    assert load.shape == (3, 8) and np.all(np.isnan(load[0]))
    np.testing.assert_allclose(load[1:].sum(1), 1.0, rtol=1e-5)
    # every MoE layer's expert bias took one step of the rule on its own load (+-0.5 or 0)
    nt = new["non_trainable"]["non_trainable"]["transformer"]
    bias = np.asarray((nt["repeat"]["sub"]["x_layers_0"] if repeat else {
        "ff_layer": {
            "expert_bias": np.stack(
                [nt[f"x_layers_{l}"]["ff_layer"]["expert_bias"] for l in (1, 2)])
        }
    })["ff_layer"]["expert_bias"])
    assert bias.shape == (2, 8)
    np.testing.assert_array_equal(bias, 0.5 * np.sign(load[1:].mean(1, keepdims=True) - load[1:]))
    with pytest.raises(ValueError,
                       match=r"first_k_dense=4 is invalid: an int in \[0, num_layers=3\]"):
        models.transformer_lm(model_dims=8,
                              hidden_dims=8,
                              num_layers=3,
                              num_heads=2,
                              num_experts=2,
                              first_k_dense=4)


def test_read_metrics_keeps_the_last_record_per_step_and_plot(tmp_path):
    p = tmp_path / "metrics.jsonl"
    recs = [{"kind": "train", "step": s, "xent": 5.0 - 0.01 * s, "loss": 5.0} for s in range(1, 30)]
    recs += [{"kind": "train", "step": 12, "xent": 1.5, "loss": 1.0}]  # a resumed run's redo
    recs += [{"kind": "eval", "step": s, "heldout_loss": 4.0 - 0.02 * s} for s in (0, 10, 20)]
    recs += [{"kind": "expert_load", "step": 20, "load": np.full((2, 8), 0.125).tolist()}]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    got = metrics.read_metrics(p)
    steps12 = [r for r in got if r["kind"] == "train" and r["step"] == 12]
    assert len(steps12) == 1 and steps12[0]["xent"] == 1.5
    assert [r["step"] for r in got] == sorted(r["step"] for r in got)
    png = metrics.plot_summary(p, tmp_path / "s.png", title="t")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000


def test_optimizer_clips_and_schedules():
    import jax.numpy as jnp

    opt = base.OptimizerConfig(learning_rate=1.0,
                               warmup_steps=10,
                               schedule="cosine",
                               end_lr_fraction=0.1,
                               clip_norm=0.5,
                               weight_decay=0.0)
    _, sched = steps.make_optimizer(opt, num_steps=110)
    assert float(sched(0)) == 0.0 and abs(float(sched(10)) - 1.0) < 1e-6
    assert abs(float(sched(60)) - (0.1 + 0.9 * 0.5)) < 1e-5  # half way down the cosine
    assert abs(float(sched(110)) - 0.1) < 1e-6
    # Adam's first step is -lr * g / (|g| + eps) elementwise; with eps = 1 it depends on the
    # scale of g, so it shows whether g was clipped to global norm 0.5 first.
    opt = base.OptimizerConfig(learning_rate=0.5,
                               warmup_steps=0,
                               schedule="constant",
                               eps=1.0,
                               clip_norm=0.5,
                               weight_decay=0.0)
    tx, sched = steps.make_optimizer(opt, num_steps=10)
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.array([3.0, 4.0])}  # global norm 5
    upd, _ = tx.update(g, tx.init(params), params)
    lr0 = float(sched(0))
    gc = np.array([3.0, 4.0]) * 0.5 / 5.0
    np.testing.assert_allclose(np.asarray(upd["w"]), -lr0 * gc / (np.abs(gc) + 1.0), rtol=1e-5)
    assert lr0 > 0


# --------------------------------------------------------------------------------- docs


def _doc():
    return (ROOT / "docs" / "experiments.md").read_text()


def test_docs_list_every_flag_of_main():
    doc = _doc()
    ours = [
        "exp", "job_log_dir", "mode", "num_processes", "process_id", "coordinator_address",
        "no_progress", "allow_config_change", "verbose_errors"
    ]
    for name in ours:
        assert f"`--{name}" in doc, name
        fl = flags.FLAGS[name]
        default = fl.default
        row = re.search(rf"^\| `--{name}[^|]*\| ([^|]*)\|", doc, re.M)
        assert row, f"--{name} has no row in the flag table"
        assert row.group(1).strip() == f"`{default!r}`" if default is not None else \
            row.group(1).strip() == "`None`", (name, row.group(1))
    for name in ("fdl_config", "fdl_config_file", "fdl_set", "fiddler"):
        assert name in flags.FLAGS and f"`--{name}" in doc


@pytest.mark.parametrize("cls",
                         [base.DataConfig, base.OptimizerConfig, base.MeshConfig, base.TrainConfig])
def test_docs_list_every_config_field_with_its_default(cls):
    doc = _doc()
    prefix = {
        "DataConfig": "data",
        "OptimizerConfig": "optimizer",
        "MeshConfig": "mesh",
        "TrainConfig": "train"
    }[cls.__name__]
    for f in dataclasses.fields(cls):
        default = f.default
        row = re.search(rf"^\| `{prefix}\.{f.name}` \| ([^|]*)\|", doc, re.M)
        assert row, f"{prefix}.{f.name} is not documented"
        assert row.group(1).strip() == f"`{default!r}`", (f.name, row.group(1), default)


def test_docs_list_every_registered_experiment():
    doc = _doc()
    for full in registry.all_experiments():
        assert f"`{full}`" in doc, full


def test_missing_text_path_is_a_config_error(tmp_path):
    parse("--fdl.data.source='text'", f"--fdl.data.path='{tmp_path / 'missing'}'")
    cfg, _ = main_lib.config_from_flags()
    with pytest.raises(setup.ConfigError, match=r"--fdl.data: .*missing' is neither a file"):
        setup.prepare(cfg)


def test_docs_list_every_knob():
    doc = _doc()
    knobs = [k for k in vars(experiments.LanguageModel) if k.isupper()]
    assert len(knobs) > 30
    listed = set(
        re.findall(r"\b[A-Z][A-Z0-9_]+\b",
                   doc.split("Knobs (class attributes")[1].split("The model (")[0]))
    assert listed == set(knobs), (set(knobs) - listed, listed - set(knobs))


def test_fdl_config_file_round_trip(tmp_path):
    from fiddle.experimental import serialization

    for fn in (experiments.tiny, experiments.deepseek_v3):
        path = tmp_path / f"{fn.__name__}.json"
        path.write_text(serialization.dump_json(fn()))
        parse(f"--fdl_config_file={path}", "--fdl.train.num_steps=3")
        cfg, name = main_lib.config_from_flags()
        want = fn()
        want.train.num_steps = 3
        assert cfg == want and name == want.name
        if fn is experiments.tiny:
            assert setup.prepare(cfg).config.train.num_steps == 3  # the loaded config builds


def test_current_mesh_inside_jit_is_the_concrete_mesh():
    """The trainer jits under jax.set_mesh; the MoE layer asks compat.current_mesh() while
    traced, where jax.sharding.get_mesh() refuses to run."""
    import jax
    import jax.numpy as jnp

    from moe_praxis.praxis import compat

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    seen = []

    def f(x):
        seen.append(compat.current_mesh())
        return x + 1

    with jax.set_mesh(mesh):
        jax.jit(f)(jnp.zeros(8))
    assert seen[0] == mesh and isinstance(seen[0], jax.sharding.Mesh)
    jax.jit(f)(jnp.ones(8))
    assert seen[1] is None
