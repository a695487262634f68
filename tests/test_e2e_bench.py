"""benchmarks.e2e on the CPU: a tiny experiment's real train step for 2 steps (the JSON's fields,
the FLOP count against the preset's shapes), and the breakdown's part table as pure functions."""

import json

import pytest

from benchmarks import e2e, e2e_parts, layer_breakdown
from configs import models


def test_peak_table():
    assert e2e.peak_tflops("NVIDIA H200") == 989.0
    assert e2e.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert e2e.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert e2e.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert e2e.peak_tflops("cpu") is None


FWD = "jit(train_fn)/jvp(lm.apply)/lm/transformer/x_layers_0"
BWD = "jit(train_fn)/transpose(jvp(lm.apply))/lm/transformer/x_layers_1"


@pytest.mark.parametrize("target, op_name, kernel, part", [
    ("moe_grouped_gemm_fwd", f"{FWD}/ff_layer/ff_layer._moe/moe_experts/x", "k", "MoE layers"),
    ("__cudnn$fmhaSoftmaxBackward", f"{BWD}/self_attention/y", "k", "attention"),
    ("", f"{FWD}/ff_layer/ff_layer._moe/moe_router/dot_general", "k", "MoE layers"),
    ("", f"{BWD}/ff_layer/add_any", "k", "MoE layers"),
    ("", f"{FWD}/self_attention/query/einsum/ABD,DNH->ABNH/dot_general", "k", "attention"),
    ("", f"{FWD}/self_attention/query/convert_element_type", "k", "casts"),
    ("", f"{FWD}/ff_layer/ffn_layer1/linear/einsum/dot_general", "k", "dense FFN"),
    ("", f"{FWD}/layer_norm/rsqrt", "k", "norms"),
    ("", "jit(train_fn)/jvp(lm.apply)/lm/final_ln/mul", "k", "norms"),
    ("", "jit(train_fn)/jvp(lm.apply)/lm/lm.compute_loss/softmax/reduce_sum", "k",
     "embedding + softmax + loss"),
    ("", "jit(train_fn)/jvp(lm.apply)/lm/lm._prepare_input/softmax.emb_lookup/gather", "k",
     "embedding + softmax + loss"),
    ("", "jit(train_fn)/jit(clip)/max", "k", "optimizer"),
    ("", "jit(train_fn)/mul", "k", "optimizer"),
    ("", "state['opt_state'][0][0].mu['x']", "k", "optimizer"),
    ("", "reduce_sum", "k", e2e_parts.OTHER),
])
def test_part_of_an_instruction(target, op_name, kernel, part):
    assert e2e_parts.part_of(dict(target=target, op_name=op_name, gemm=False), kernel) == part


@pytest.mark.parametrize("kernel, part", [("cudnn_generated_fort_native_sdpa_sm90", "attention"),
                                          ("cutlass3x_sm90_grouped_gemm", "MoE layers"),
                                          ("loop_add_fusion", e2e_parts.OTHER)])
def test_part_of_a_kernel_with_no_instruction(kernel, part):
    assert e2e_parts.part_of(None, kernel) == part


def test_every_part_is_in_the_table_order():
    parts = {p for p, _, _ in e2e_parts.PARTS} | {p for p, _ in e2e_parts.KERNEL_NAMES}
    assert parts | {e2e_parts.OTHER} == set(e2e_parts.ORDER)
    text = layer_breakdown.table(
        "t", {
            "gpu_ms": 2.0,
            "stages": {
                p: dict(ms=1.0, kernels=1)
                for p in ("attention", "optimizer")
            },
            "attributed": {},
            "top_other": []
        }, 4.0, e2e_parts.ORDER)
    assert "| attention | 1.000 | 50.0 | 1 |" in text and "| optimizer |" in text


def test_usage_errors():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--steps", "2"])  # neither --exp nor --summary
    with pytest.raises(SystemExit):
        e2e.parse_args(["--exp", "tiny", "--remat", "most"])


def test_stack_switch_keeps_the_experiment_and_its_remat():
    """--stack changes only the experiment's REPEAT: mixtral_moe_gpu (a scanned block by
    default) with each layer its own weights keeps its name, layers and remat policy; Tiny
    (unrolled by default) scanned."""
    for exp, stack in (("mixtral_moe_gpu", "layers"), ("tiny", "repeated")):
        mesh = ["--fdl_set", "mesh.shape=(-1,)"]  # the suite's 8 host devices
        default, _ = e2e.build(e2e.parse_args(["--exp", exp] + mesh))
        prep, cfg = e2e.build(e2e.parse_args(["--exp", exp, "--stack", stack] + mesh))
        assert e2e.stack_kind(prep.model_config) == stack != e2e.stack_kind(default.model_config)
        assert cfg.name == exp
        if exp == "mixtral_moe_gpu":  # its REMAT names a policy: the same on either stack
            assert models.remat_policy(prep.model_config) == "save_dot_except_mlp"
        assert models.num_layers(prep.model_config) == models.num_layers(default.model_config)
    r = dict(stack="layers", stack_changed=True, fdl_set=["data.batch_size=8"])
    assert e2e.changes(r) == "--stack layers data.batch_size=8"
    assert e2e.changes(dict(r, stack_changed=False, fdl_set=[])) == ""


@pytest.mark.slow
def test_tiny_experiment_two_steps(tmp_path, capsys):
    """Two timed steps of Tiny with the command line's switches: the JSON's numbers are
    consistent, the FLOPs are the formula over Tiny's shapes (2 MoE layers of 8 experts
    H=M=128 top-2, seq 64, 4 heads of 32), the breakdown is skipped on the CPU with the HLO's
    instructions counted by part."""
    path = tmp_path / "e2e_tiny.json"
    assert e2e.main([
        "--exp", "tiny", "--steps", "2", "--warmup", "1", "--attention", "xla", "--remat",
        "save_attention_and_moe_gemms", "--breakdown", "--fdl_set", "data.batch_size=8", "--json",
        str(path)
    ]) == 0
    r = json.loads(path.read_text())
    assert (r["exp"], r["attention_impl"], r["remat"]) == ("tiny", "xla",
                                                           "save_attention_and_moe_gemms")
    assert r["tokens_per_step"] == 8 * 64 and len(r["step_ms_all"]) == 2
    assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1e3)
    f = r["flops"]
    expert = 2 * 3 * 8 * 128 * 128
    assert f["expert_params"] == expert
    assert f["active_params"] == pytest.approx(f["params"] - expert + expert * 2 / 8)
    assert f["flops_per_token"] == pytest.approx(6 * f["active_params"] + 12 * 2 * 64 * 128)
    assert r["tflops_per_sec"] == pytest.approx(f["flops_per_token"] * r["tokens_per_sec"] / 1e12)
    assert r["mfu"] is None and any("MFU left out" in n for n in r["notes"])
    assert any("xla route" in m for m in r["attention_routes"])
    bd = r["breakdown"]
    assert "no GPU kernels" in bd["skipped"]
    for part in ("MoE layers", "attention", "norms", "embedding + softmax + loss", "optimizer"):
        assert bd["hlo_instructions"][part] > 0, (part, bd["hlo_instructions"])
    out = capsys.readouterr().out
    assert "6 x active parameters + 12 x layers x seq_len x attention width" in out
    assert r["fdl_set"] == ["data.batch_size=8"] and "config changes: data.batch_size=8" in out
    assert e2e.main(["--summary", str(tmp_path)]) == 0
    assert "| tiny | xla | save_attention_and_moe_gemms | data.batch_size=8 |" in capsys.readouterr(
    ).out
