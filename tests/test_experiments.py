"""Experiments before any compilation: the registry of experiment classes, the job's flags
(--exp, --fdl_config, --fdl_config_file, --fdl / --fdl_set overrides, fiddlers) and the config
errors they raise, and the mesh and sharding an experiment writes. In-process and fast; the data,
metrics and plot are in test_experiments_data.py, the model and train step in
test_experiments_steps.py, the docs kept in step with the code in test_experiments_docs.py and
the end-to-end runs in test_experiments_e2e.py."""

import dataclasses
import sys

import jax
import pytest
from fiddle.experimental import serialization
from praxis import pax_fiddle

from configs import base, experiments, registry, stack
from experiments import main as main_lib
from experiments.train import setup
from moe_praxis.config import MoEConfig
from moe_praxis.praxis import fields, layer
from tests.flagutil import parse, reset_flags  # noqa: F401  (reset_flags: autouse)

# ------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("name", [
    "configs.experiments.TinySynthetic", "experiments.TinySynthetic", "TinySynthetic",
    "tinysynthetic", "tiny_synthetic", "experiments.tiny_synthetic"
])
def test_registry_resolves_full_suffix_and_snake_names(name):
    assert registry.get_experiment(name) is experiments.TinySynthetic


def test_registry_names_are_the_fdl_config_names():
    names = {registry.short_name(c) for c in registry.all_experiments().values()}
    assert {"tiny", "tiny_synthetic", "small_gpu", "mixtral_8x7b", "deepseek_v3",
            "qwen3_moe"} <= names
    # every registered experiment has a --fdl_config entry point of the same name, in its module
    for cls in registry.all_experiments().values():
        name = registry.short_name(cls)
        assert getattr(sys.modules[cls.__module__], name)().name == name
    # and nothing else of the module is one (the registry's own helpers are not)
    for module in registry.EXPERIMENT_MODULES:
        want = sorted(
            registry.short_name(c) for c in registry.all_experiments().values()
            if c.__module__ == module)
        assert registry.config_functions(sys.modules[module]) == want, module
    assert "register" not in registry.builtin_config_functions()


def test_a_config_function_may_not_replace_a_name_of_its_module():
    """define_config_functions refuses to overwrite what a module binds under an experiment's
    name (a hand-written function of that name would silently stop being the entry point)."""
    namespace = {"__name__": experiments.__name__, "tiny": lambda: None}
    with pytest.raises(ValueError, match="configs.experiments.tiny is already defined"):
        registry.define_config_functions(namespace)


# One rule for what users type: case, '_' and '-' do not count.
TYPED = {
    "deepseek_v3": experiments.DeepSeekV3,
    "deep_seek_v3": experiments.DeepSeekV3,
    "DeepSeek-V3": experiments.DeepSeekV3,
    "mixtral_8x7b": experiments.Mixtral8x7B,
    "mixtral8x7b": experiments.Mixtral8x7B,
    "Mixtral-8x7B": experiments.Mixtral8x7B,
    "qwen3_moe": experiments.Qwen3Moe,
    "qwen3moe": experiments.Qwen3Moe,
    "experiments.deep_seek_v3": experiments.DeepSeekV3,
}


@pytest.mark.parametrize("typed", TYPED)
def test_the_names_users_type_resolve_for_exp_and_fdl_config(typed):
    cls = TYPED[typed]
    assert registry.get_experiment(typed) is cls
    parse(f"--exp={typed}")
    cfg, name = main_lib.config_from_flags()
    assert name == cfg.name == registry.short_name(cls)
    if "." not in typed:
        parse(f"--fdl_config={typed}")
        assert main_lib.config_from_flags()[0].name == registry.short_name(cls)


def test_an_unknown_name_is_one_line_listing_the_valid_names():
    with pytest.raises(LookupError) as e:
        registry.get_experiment("gpt_oss")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.endswith(
        "Registered: " +
        ", ".join(sorted(registry.short_name(c) for c in registry.all_experiments().values())))
    parse("--fdl_config=gpt_oss")
    with pytest.raises(main_lib.UsageError) as e:
        main_lib.config_from_flags()
    assert "deepseek_v3, mixtral_8x7b" in str(e.value) and "use_mesh" not in str(e.value)


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


def test_fdl_config_file_round_trip(tmp_path):
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


@pytest.mark.parametrize("arg,pattern", [
    ("--fdl.trian.num_steps=3", r"'trian'.*did you mean train"),
    ("--fdl.train.num_stepz=3", r"train has no field 'num_stepz'; did you mean num_steps"),
    ("--fdl.model.stacked_transformer_tpl.num_layer=3",
     r"model.stacked_transformer_tpl has no field 'num_layer'; did you mean num_layers"),
    ("--fdl.train.num_steps=abc", r"train.num_steps=abc: 'abc' is not a Python literal"),
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
    ("--fdl.model.vocab_size=100", r"vocab_size=100 is smaller than the tokenizer bytes"),
])
def test_invalid_config_stops_before_compilation(arg, pattern, monkeypatch):
    # Any compilation would go through jax.jit(...).lower / compile: make it fail loudly.
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


def test_too_few_devices_says_how_to_get_more():
    """EP on one CPU device names the XLA_FLAGS that gives the CPU more devices (or GPUs), and
    the count it names is one the mesh takes."""
    cfg = experiments.tiny()
    experiments.use_expert_parallel(cfg, ep=4)
    with pytest.raises(setup.ConfigError) as e:
        setup.prepare(cfg, devices=jax.devices()[:1])
    msg = str(e.value)
    flag = "XLA_FLAGS=--xla_force_host_platform_device_count="
    assert flag in msg and "GPUs" in msg, msg
    n = int(msg.split(flag)[1].split(",")[0])
    assert setup.prepare(cfg, devices=jax.devices()[:n]).mesh.devices.size == n


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
    # ep before fsdp on the expert dimension (docs/parallelism.md), from ep_bootstrap's weight specs.
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


def test_missing_text_path_is_a_config_error(tmp_path):
    parse("--fdl.data.source='text'", f"--fdl.data.path='{tmp_path / 'missing'}'")
    cfg, _ = main_lib.config_from_flags()
    with pytest.raises(setup.DataError, match=r"^data.path='.*missing': no such file or dir"):
        setup.prepare(cfg)


def test_moe_knobs_are_the_layer_fields_in_capitals_with_moeconfig_defaults():
    """Every MOE_KNOBS knob reaches the MoE layers' field of its name, starts from MoEConfig's
    default of that field (through the layer's field table), and docs/experiments.md names it;
    a changed knob reaches the built layer."""
    by_layer = {v: k for k, v in fields.CONFIG_FIELDS.items()}
    moe_defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    layer_fields = {f.name for f in dataclasses.fields(layer.MoEFeedForward)}
    lm = experiments.LanguageModel()
    knobs = experiments.MOE_KNOBS + experiments.LAYER_KNOBS
    assert lm.moe_fields() == {f: getattr(lm, f.upper()) for f in knobs}
    for field in experiments.MOE_KNOBS:
        assert field in layer_fields, field
        assert getattr(experiments.LanguageModel, field.upper()) == moe_defaults[by_layer[field]]
    layer_defaults = {f.name: f.default for f in dataclasses.fields(layer.MoEFeedForward)}
    for field in experiments.LAYER_KNOBS:
        assert field not in by_layer, f"{field} is MoEConfig's: a MOE_KNOBS knob"
        assert getattr(experiments.LanguageModel, field.upper()) == layer_defaults[field]

    class Changed(experiments.Tiny):
        SCORE_FUNC = "sigmoid"
        NUM_SHARED_EXPERTS = 1
        ROUTER_INIT_SCALE = 0.1

    cfg = Changed().experiment_config()
    built = [pax_fiddle.build(c) for _, c in stack.moe_layer_configs(cfg.model)]
    assert built and all(
        (b.score_func, b.num_shared_experts, b.router_init_scale) == ("sigmoid", 1, 0.1)
        for b in built)
    with pytest.raises(KeyError, match="sets no MoEConfig field"):
        fields.config_default("num_heads")
