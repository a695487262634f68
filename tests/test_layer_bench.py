"""The layer benchmark (`python -m benchmarks.layer`) on the CPU: the --quick run end
to end, its stage table, its targets and its options. Speed is asserted by the benchmark's
output on a GPU, never here."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import e2e
from benchmarks import fp8_quality
from benchmarks import layer_breakdown as lb
from benchmarks import layer_cases as lc
from benchmarks import layer_check
from benchmarks import layer_report
from moe_praxis.ops.fp8 import rule as fp8_rule
from moe_praxis.ops import grouped_gemm_tiles as gg_tiles
from tests.grouped_gemm_util import _fake_device
from tests.testutil import long_options

ROOT = Path(__file__).resolve().parents[1]
# XLA:CPU compile time dominates the quick run; LLVM's optimisation level changes speed only.
FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "layer.json"
    env = dict(os.environ, XLA_FLAGS=FAST, PYTHONPATH=str(ROOT))
    p = subprocess.run([
        sys.executable, "-m", "benchmarks.layer", "--quick", "--shapes", "mixtral", "--methods",
        "cuda,xla,layer,gshard,ideal", "--gshard-groups", "4", "--breakdown", "--reps", "1",
        "--json",
        str(out)
    ],
                       cwd=ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| PASS/FAIL |" in p.stdout and ("| PASS |" in p.stdout or "| FAIL |" in p.stdout)
    res = json.loads(out.read_text())
    methods = {(r["load"], r["pass_"], r["method"]) for r in res["rows"] if r.get("ms")}
    for load in ("balanced", "skewed"):
        for pass_ in ("fwd", "fwd+bwd"):
            for m in ("cuda", "xla", "layer", "ideal", "roofline"):
                assert (load, pass_, m) in methods, (load, pass_, m, sorted(methods))
            if load == "balanced":
                assert (load, pass_, "gshard cf2.5") in methods
    # the check against 'xla' ran and passed ('cuda' is 'xla' on the CPU)
    assert res["checks"] and all(c["ok"] for c in res["checks"]), res["checks"]
    # the skew reached the target (Mixtral-like k=2 of 8: 4x the mean is every token)
    skew = res["skew"]["mixtral"]
    assert skew["skewed"]["max_over_mean"] >= 3.9 and skew["balanced"]["max_over_mean"] < 2
    gs = [r for r in res["rows"] if r["method"] == "gshard cf2.5"]
    assert all(0 <= r["dropped"] < 0.5 and r["num_groups"] == 4 for r in gs), gs
    targeted = [r for r in res["rows"] if r.get("verdict")]
    assert {r["load"] for r in targeted} == {"balanced", "skewed"}
    # the grouped GEMM configurations the rule picks at the shape are in the JSON
    q = lc.QUICK_SHAPES["mixtral"]
    cfgs = res["gemm_configs"]["mixtral"]
    assert cfgs["wo"]["dgrad"] == gg_tiles.choose_config("dgrad", q.t * q.k, q.h, q.m, q.e)
    assert set(cfgs) == {"wi", "wo", "gate_up_fused", "dswiglu"}
    assert set(cfgs["wi"]) == set(gg_tiles.OPS), cfgs
    # no GPU: the breakdown says why and the run goes on
    assert "no GPU" in res["breakdown"]["mixtral"]["cuda"]["skipped"]
    assert "breakdown mixtral cuda: skipped" in p.stdout


def test_stage_table_on_the_compiled_hlo():
    """Every instruction of moe_block's fwd+bwd is given a stage by its op_name; the router
    GEMM (forward and both backward GEMMs) and the expert GEMMs are found by scope, and
    custom-call targets and bare kernel names map by the documented table."""
    sh = lc.QUICK_SHAPES["qwen3"]
    cfg = lc.config(sh, kernel_backend="xla")
    p = lc.make_params(sh, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (sh.t, sh.m), jnp.bfloat16)
    hlo = lc.block_fns(cfg)["fwd+bwd"].lower(p, x, x).compile().as_text()
    index = lb.hlo_index(hlo)
    stages = {n: lb.stage_of(i, n) for n, i in index.items()}
    router = [index[n]["op_name"] for n, s in stages.items() if s == "router GEMM"]
    assert any("transpose(jvp(moe_router))" in o for o in router), router
    # (router_precision 'auto' puts the dot in a platform_dependent branch: .../cond/branch_0_fun)
    assert any("jvp(moe_router)/" in o and "transpose" not in o and o.endswith("/dot_general")
               for o in router), router
    assert "expert GEMMs (XLA)" in stages.values()
    assert "sort / capacity (XLA ops)" in stages.values()
    info = lambda target="", op_name="", gemm=False: dict(target=target, op_name=op_name, gemm=gemm)
    assert lb.stage_of(info("moe_grouped_gemm_wgrad"), "k") == "grouped GEMM wgrad"
    assert lb.stage_of(info("moe_router_bwd"), "k") == "routing kernel"
    assert lb.stage_of(info("moe_unpermute"), "k") == "unpermute / combine"
    assert lb.stage_of(info("moe_unpermute_indexed"), "k") == "unpermute / combine"
    assert lb.stage_of(info("moe_permute_index"), "k") == "permute"
    assert lb.stage_of(info(op_name="jit(f)/jvp()/add"), "k") == lb.OTHER
    assert lb.stage_of(None, "void router_fwd_kernel<float>") == "routing kernel"
    assert lb.stage_of(None, "cutlass::device_kernel<GemmUniversal>") == \
        "grouped GEMM (op not known)"
    # a kernel is tied to its instruction by hlo_op, by its own name, or by the XLA Ops line
    name = next(n for n, s in stages.items() if s == "router GEMM")
    ev = dict(name="sm90_xmma_gemm", ts=10.0, dur=2.0, args={"hlo_op": name})
    assert lb._instruction(ev, index, [])[1] == "hlo_op"
    ev = dict(name="sm90_xmma_gemm", ts=10.0, dur=2.0, args={})
    ops = [dict(name="%" + name, ts=9.0, dur=5.0, args={})]
    found, how = lb._instruction(ev, index, ops)
    assert how == "XLA Ops line" and lb.stage_of(found, ev["name"]) == "router GEMM"


def test_idle_gaps_inside_steps_not_between_them():
    """Two traced steps of three kernels (one pair overlapping on two streams): the gap between
    the steps is left out, the in-step gaps are summed per step and charged to the stage of the
    kernel after them."""

    def ev(ts, dur, stage):
        return dict(name=f"k_{stage}", ts=ts, dur=dur, stage=stage, args={})

    step = lambda t0: [
        ev(t0, 10, "a"),
        ev(t0 + 4, 10, "b"),
        ev(t0 + 20, 5, "c"),
        ev(t0 + 40, 1, "a")
    ]
    events = step(0.0) + step(1000.0)  # in-step gaps: 14 -> 20 (6 us), 25 -> 40 (15 us)
    res = lb.idle_gaps(events[::-1], reps=2)  # any event order
    assert res["idle_ms"] == pytest.approx(21e-3)
    assert res["gaps"] == 2
    assert res["by_next_stage"] == {"a": pytest.approx(15e-3), "c": pytest.approx(6e-3)}
    assert res["largest"][0][:3] == (15.0, "c", "a")
    assert all(g[0] < 100 for g in res["largest"])  # the 959 us between the steps left out
    assert res["between_steps_ms"] == pytest.approx(959e-3)


def _row(shape, load, method, ms, **kw):
    return dict(shape=shape, load=load, pass_="fwd+bwd", method=method, ms=ms, **kw)


def test_targets_are_issue_23s():
    rows = [
        _row("qwen3", "balanced", "cuda", 10.0, pct_ideal=80.0),
        _row("qwen3", "balanced", "cuda+fuse", 10.0, pct_ideal=79.9),
        _row("deepseek", "balanced", "cuda", 10.0, pct_ideal=60.0, pct_roofline=90.0),
        _row("deepseek", "balanced", "cuda+fuse", 10.0, pct_ideal=74.0, pct_roofline=89.0),
        _row("mixtral", "balanced", "cuda", 10.0, pct_ideal=96.0, x_gshard=1.25),
        _row("mixtral", "balanced", "cuda+fuse", 10.0, pct_ideal=96.0, x_gshard=None),
        _row("qwen3", "skewed", "cuda", 11.5),
        _row("qwen3", "skewed", "cuda+fuse", 11.6),
        _row("qwen3", "balanced", "xla", 10.0, pct_ideal=99.0),
    ]
    layer_report.targets(rows)
    assert [r.get("verdict") for r in rows
            ] == ["PASS", "FAIL", "PASS", "FAIL", "PASS", "FAIL", "PASS", "FAIL", None]


def test_options_are_checked_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        layer_report.parse_args(["--shapes", "mixtral,llama"])
    err = capsys.readouterr().err
    assert "['llama']" in err and "mixtral, qwen3, deepseek" in err
    opts = layer_report.parse_args(["--quick"])
    assert opts.methods == list(lc.METHODS) and opts.skew and opts.reps == 2
    assert opts.json == "benchmarks/results/layer_bench.json"


def test_options_and_device_script_knobs_are_documented():
    """Every option of the layer benchmark and every knob of its device script (and of the
    end-to-end and FP8 quality ones) is in docs/performance.md, and the page names no option
    the benchmarks lack."""
    text = (ROOT / "docs/performance.md").read_text()
    opts = long_options(layer_report.build_parser())
    assert {"--shapes", "--methods", "--skew", "--breakdown", "--json", "--quick"} <= opts
    missing = sorted(o for o in opts if o not in text)
    assert not missing, f"options missing from docs/performance.md: {missing}"
    others = {}  # the end-to-end and FP8 quality benchmarks' options, also there
    for name, mod in (("benchmarks.e2e", e2e), ("benchmarks.fp8_quality", fp8_quality)):
        others[name] = long_options(mod.build_parser())
        missing = sorted(o for o in others[name] if o not in text)
        assert not missing, f"{name} options missing from docs/performance.md: {missing}"
    unknown = set(re.findall(r"`(--[a-z0-9_-]+)", text)) - opts.union(*others.values())
    assert not unknown, f"docs/performance.md names options the benchmarks lack: {unknown}"

    def knobs_of(script):  # ${NAME:-default} and ${NAME-default}
        body = (ROOT / "benchmarks" / script).read_text()
        return set(re.findall(r"\$\{([A-Z_]+):?-", body)) - {"OUT", "PYTHONPATH", "XLA_FLAGS"}

    knobs = knobs_of("layer_device_run.sh")
    assert "BREAKDOWN_S" in knobs
    knobs |= knobs_of("e2e_device_run.sh")
    assert {"RUNS", "BREAKDOWN"} <= knobs
    fq_knobs = knobs_of("fp8_quality_device_run.sh")
    assert {"SEEDS", "CONTROL", "VARIANTS", "LR", "STEPS", "EVAL", "KEEP"} <= fq_knobs
    knobs |= fq_knobs
    for knob in knobs:
        assert knob in text, f"device-script knob {knob} is not in docs/performance.md"


def test_cuda_sm80_method_traces_its_steps_with_the_sm80_grouped_gemm(monkeypatch):
    """'cuda-sm80' forces the sm_80 grouped GEMM kernels while its steps are traced
    (lc.GROUPED_GEMM_FAMILY, Shape.forcing): on a faked H200, its step lowered for CUDA calls
    the sm_80 targets and the 'cuda' step, lowered after it in the same process, the Hopper
    ones."""
    import re as _re

    from benchmarks import layer
    from moe_praxis.ops import backend

    _fake_device(monkeypatch, 90, "NVIDIA H200")
    assert lc.GROUPED_GEMM_FAMILY == {"cuda-sm80": "sm80"} and "cuda-sm80" in lc.METHODS
    sh = layer.Shape("qwen3", lc.QUICK_SHAPES["qwen3"], ["cuda", "cuda-sm80"], "cuda",
                     jax.random.key(0))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in backend.KERNELS]
    targets = {}
    for method in ("cuda-sm80", "cuda"):
        with sh.forcing(method):
            exp = jax.export.export(sh.fns(method)["fwd+bwd"],
                                    platforms=["cuda"],
                                    disabled_checks=checks)(*sh.args(method, "fwd+bwd", "balanced"))
        targets[method] = set(_re.findall(r"custom_call @(moe_grouped_gemm\w*)", exp.mlir_module()))
    assert targets["cuda-sm80"] == {
        f"moe_grouped_gemm_sm80_{op}"
        for op in ("fwd", "dgrad", "wgrad")
    }, targets
    assert targets["cuda"] == {f"moe_grouped_gemm_{op}" for op in ("fwd", "dgrad", "wgrad")}
    assert backend.grouped_gemm_kernel()[0] == "sm90"  # nothing forced outside


def test_fp8_check_runs_the_fp8_gemms_the_timed_call_runs():
    """benchmarks.layer_check.fp8_check_params: an FP8 method whose timed call (the shape's T
    tokens) has enough rows per expert for 'auto' gets its weights' FP8 form for the check (so
    the check's slice, under FORM_MIN_ROWS rows per expert, runs FP8 instead of the bf16
    layer); below that, and for methods without fp8, the params are unchanged."""
    small = lc.Shape(256, 128, 128, 4, 2, {})
    params = lc.make_params(small, jax.random.key(0))
    pays = small._replace(t=fp8_rule.FORM_MIN_ROWS * small.e // small.k)
    short = pays._replace(t=pays.t - small.e)
    fp8_cfg = lc.config(small, kernel_backend="xla", fp8="blockwise")
    got, given = layer_check.fp8_check_params(fp8_cfg, pays, params)
    assert given and set(got["fp8_weights"]) == {"wi_gate", "wi_up", "wo"}
    assert got["wi_gate"] is params["wi_gate"]
    for cfg, shape in ((fp8_cfg, short), (lc.config(small, kernel_backend="xla"), pays)):
        got, given = layer_check.fp8_check_params(cfg, shape, params)
        assert not given and got is params
    # 'all' runs FP8 at any rows
    all_cfg = lc.config(small, kernel_backend="xla", fp8="blockwise", fp8_gemms="all")
    assert layer_check.fp8_check_params(all_cfg, short, params)[1]


def test_check_verdict_tells_an_error_not_computed_from_a_failure():
    """layer_check.verdict: an error chunked_rel_err could not compute (None: it ran out of
    memory) makes the check NOT CHECKED when the computed ones pass, FAIL when one of them
    fails; an exception before any error is a FAIL."""
    tol = layer_check.CHECK_TOL
    ok = dict(ok=True, rel_err={"y": tol / 2}, unchecked=[], tol=tol)
    assert layer_check.verdict(ok) == "PASS"
    half = dict(ok=False, rel_err={"y": tol / 2, "dx": None, "dwo": None}, tol=tol)
    half["unchecked"] = ["dwo", "dx"]
    assert layer_check.verdict(half) == "NOT CHECKED (dwo, dx: error not computed)"
    half["rel_err"]["y"] = 2 * tol
    assert layer_check.verdict(half) == "FAIL"
    assert layer_check.verdict(dict(ok=False, error="RESOURCE_EXHAUSTED")) == "FAIL"
