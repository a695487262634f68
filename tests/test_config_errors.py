"""Config and flag errors are one line with exit status 2, found before anything is traced
and overrides of the fields Praxis's StackedTransformer overwrites on its MoE
template take effect or are refused naming where to set them (item 5). In-process through
main's ``_main`` with parsed flags; one subprocess run checks the real command line."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from configs import experiments, stack
from experiments.train import loop, setup, steps
from experiments import main as main_lib
from tests.flagutil import parse, reset_flags  # noqa: F401  (reset_flags: autouse)

ROOT = Path(__file__).resolve().parents[1]
TPL = "--fdl.model.stacked_transformer_tpl.moe_layer_tpl"
STACK = "--fdl.model.stacked_transformer_tpl"


@pytest.fixture
def nothing_traced(monkeypatch):
    """Any trace, compile or trainer fails the test loudly."""

    def traced(*a, **k):
        raise AssertionError("traced or compiled before the config was checked")

    for name in ("jit", "eval_shape", "make_jaxpr"):
        monkeypatch.setattr(jax, name, traced)
    monkeypatch.setattr(loop, "Trainer", traced)


def _one_line_exit_2(capsys, *args) -> str:
    parse(*args)
    rc = main_lib._main(["main"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(err) == 1 and err[0].startswith("experiments.main: error: "), err
    return err[0]


@pytest.mark.parametrize("arg,pattern", [
    (f"{TPL}.unadjusted_expert_capacity_factor=-1.0",
     "'layer_0.ff_layer': unadjusted_expert_capacity_factor=-1.0 is not supported: must be >= 0"),
    (f"{TPL}.kernel_backend='tpu'",
     "MoEConfig.kernel_backend='tpu' is invalid: valid: ('auto', 'xla', 'cuda')"),
    (f"{STACK}.gating_func='expert_choice'",
     "gating_func='expert_choice' is not supported: valid: ('top2', 'dense_top2', 'topk')"),
    (f"{STACK}.dropout_prob=0.1", "relu_dropout_prob=0.1 is not supported: dropout on the "
     "experts' hidden activations is not implemented"),
    (f"{STACK}.dropout_prob=1.5",
     "model.stacked_transformer_tpl.dropout_prob=1.5 is invalid: must be in [0, 1)"),
    ("--fiddler=use_expert_parallel(epp=4)", "--fiddler='use_expert_parallel(epp=4)': TypeError: "
     "use_expert_parallel() got an unexpected keyword argument 'epp'; fiddlers in "
     "configs.experiments: use_expert_parallel"),
    ("--fdl_config_file=/nope.json",
     "--fdl_config_file='/nope.json' does not load: FileNotFoundError: No such file"),
    ("--fdl.train.num_steps='ten'", "--fdl.train: TrainConfig.num_steps='ten' is invalid: must "
     "be a positive int"),
    ("--fdl.train.num_steps=-5", "--fdl.train: TrainConfig.num_steps=-5 is invalid"),
    ("--fdl.optimizer.mu_dtype='float16'", "--fdl.optimizer: OptimizerConfig.mu_dtype='float16' "
     "is invalid: valid: ('float32', 'bfloat16')"),
    ("--fdl.model.model_dims=96", "model.model_dims=96 differs from model.stacked_transformer_tpl"
     ".model_dims=128: TransformerLm gives the stack its own model_dims"),
    (f"{TPL}.norm_policy='post'", "model.stacked_transformer_tpl.moe_layer_tpl.norm_policy='post'"
     " has no effect: the stack sets norm_policy on MoE layer 0 from model.stacked_transformer_"
     "tpl.transformer_layer_params_tpl.norm_policy (= 'pre'); set it there"),
])
def test_config_and_flag_errors_are_one_line_before_tracing(arg, pattern, tmp_path, capsys,
                                                            nothing_traced):
    job = tmp_path / "job"
    line = _one_line_exit_2(capsys, arg, f"--job_log_dir={job}")
    assert pattern in line, line
    assert "decay_steps" not in line  # a field derived from the one given is not named
    assert not job.exists()


@pytest.mark.parametrize("data, pattern", [
    ("--fdl.data.path='{tmp}/missing'", "data.path='{tmp}/missing': no such file or directory"),
    ("--fdl.data.tokenizer='{tmp}/no.model'", "data.tokenizer='{tmp}/no.model': no such file"),
])
def test_a_data_error_under_a_valid_config_is_not_called_an_invalid_config(
        data, pattern, tmp_path, capsys, nothing_traced):
    job = tmp_path / "job"
    corpus = f"--fdl.data.path='{tmp_path}'" if "tokenizer" in data else "--no_progress"
    (tmp_path / "a.txt").write_text("some text")
    line = _one_line_exit_2(capsys, data.format(tmp=tmp_path), corpus, f"--job_log_dir={job}")
    assert line.startswith("experiments.main: error: " + pattern.format(tmp=tmp_path)), line
    assert not job.exists()


def test_fiddler_after_fdl_config_is_one_line(capsys, nothing_traced, tmp_path):
    line = _one_line_exit_2(capsys, "--fdl_config=tiny", "--fiddler=use_mesh(shapes=(2, 4))",
                            f"--job_log_dir={tmp_path}")
    assert "--fiddler='use_mesh(shapes=(2, 4))': AttributeError: No parameter named 'shapes'" in line


def test_an_unwritable_job_log_dir_is_one_line(tmp_path, capsys, nothing_traced):
    (tmp_path / "file").write_text("")
    job = tmp_path / "file" / "run"
    line = _one_line_exit_2(capsys, f"--job_log_dir={job}")
    assert f"--job_log_dir='{job}' is not a directory this job can write (NotADirectoryError" \
        in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_job_log_dir_is_one_line(tmp_path, capsys, nothing_traced):
    job = tmp_path / "job"
    job.mkdir()
    job.chmod(0o555)
    try:
        line = _one_line_exit_2(capsys, f"--job_log_dir={job}")
    finally:
        job.chmod(0o755)
    assert "is not a directory this job can write (PermissionError" in line


def test_verbose_errors_prints_the_traceback_first(capsys, nothing_traced, tmp_path):
    parse("--fdl.model.model_dims=96", "--verbose_errors", f"--job_log_dir={tmp_path}")
    assert main_lib._main(["main"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and "ValueError: model.model_dims=96" in "\n".join(err)
    assert err[-1].startswith("experiments.main: error: invalid config: model.model_dims=96")


# ----------------------------------------------------------- fields the stack overwrites


def test_num_experts_override_on_the_template_takes_effect():
    parse(f"{TPL}.num_experts=4", f"{TPL}.gating_func='dense_top2'")
    cfg, _ = main_lib.config_from_flags()
    prep = setup.prepare(cfg)
    layers = stack.moe_layer_configs(prep.model_config)
    assert [(m.num_experts, m.gating_func) for _, m in layers] == [(4, "dense_top2")] * 2
    params = steps.make_step_fns(prep).abstract_state["params"]
    routers = [
        x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if "router" in jax.tree_util.keystr(p)
    ]
    assert routers and all(s[-1] == 4 for s in routers), routers


def test_num_groups_override_reaches_a_repeated_stack():
    cfg = experiments.mixtral_8x7b()
    block = cfg.model.stacked_transformer_tpl.block
    block.moe_layer_tpl.num_groups = 3
    stack.redirect_overrides(cfg, ["model.stacked_transformer_tpl.block.moe_layer_tpl.num_groups"])
    assert block.num_groups == 3
    assert [m.num_groups for _, m in stack.moe_layer_configs(cfg.model)] == [3]


def test_conflicting_template_and_stack_overrides_are_refused(capsys, nothing_traced, tmp_path):
    line = _one_line_exit_2(capsys, f"{TPL}.num_experts=4", f"{STACK}.num_experts=2",
                            f"--job_log_dir={tmp_path}")
    assert "moe_layer_tpl.num_experts=4 and --fdl.model.stacked_transformer_tpl.num_experts=2 " \
        "disagree" in line


def test_a_template_value_set_in_code_that_the_stack_overwrites_is_refused():
    cfg = experiments.tiny()
    cfg.model.stacked_transformer_tpl.moe_layer_tpl.num_experts = 4
    with pytest.raises(setup.ConfigError,
                       match=r"moe_layer_tpl.num_experts=4 has no effect: the stack sets "
                       r"num_experts on MoE layer 0 from model.stacked_transformer_tpl."
                       r"num_experts \(= 8\); set it there"):
        setup.prepare(cfg)


def test_the_command_line_error_is_one_line(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([
        sys.executable, "-m", "experiments.main", f"{STACK}.gating_func='expert_choice'",
        f"--job_log_dir={tmp_path / 'job'}"
    ],
                       cwd=ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.splitlines() if "Warning" not in l and l.strip()]
    assert lines == [l for l in lines if l.startswith("experiments.main: error: ")] and \
        len(lines) == 1, p.stderr
    assert "gating_func='expert_choice' is not supported" in lines[0]


@pytest.mark.parametrize("value", ["text", "/data/my corpus", "/a/b$c"])
def test_the_quoting_hint_works_when_pasted_into_a_shell(value):
    """A string value without quotes: the error suggests flags that, parsed by bash (and by
    shlex), set that string."""
    parse(f"--fdl.data.path={value}")
    with pytest.raises(main_lib.UsageError) as e:
        main_lib.config_from_flags()
    msg = str(e.value)
    assert "\n" not in msg and "is not a Python literal" in msg
    suggestions = msg.split(" e.g. ", 1)[1].split(" or ")
    assert len(suggestions) == 2, msg
    for text in suggestions:
        bash = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"],
                              capture_output=True,
                              text=True,
                              check=True).stdout.split("\0")[:-1]
        assert bash == shlex.split(text) and len(bash) == 1, (text, bash)
        parse(*bash)
        cfg, _ = main_lib.config_from_flags()
        assert cfg.data.path == value
