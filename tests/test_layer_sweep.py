"""The layer benchmark's issue-37 additions on the CPU: the deepseek_ep4 shape, the token-count
sweep (its options, labels and share-of-ideal summary), and the Praxis 'layer' method run with
each shape's own routing. Speed is asserted by the benchmark's output on a GPU, never here."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from benchmarks import layer_report, layer_sweep
from benchmarks import layer_cases as lc
from moe_praxis.praxis import fields
from praxis import base_layer
from tests.main_util import ROOT
from tests.praxis_layer_util import _FAST_COMPILE as FAST


def test_deepseek_ep4_is_one_ep4_rank_of_deepseek():
    ds, ep4 = lc.SHAPES["deepseek"], lc.SHAPES["deepseek_ep4"]
    assert ep4 == ds._replace(e=ds.e // 4)
    assert ep4.t * ep4.k // ep4.e == 1024  # rows per expert at balanced load
    assert lc.QUICK_SHAPES["deepseek_ep4"].routing == ds.routing


@pytest.mark.parametrize("name", sorted(lc.QUICK_SHAPES))
def test_layer_method_runs_each_shapes_own_routing(name):
    """The 'layer' method's MoEFeedForward gets the shape's routing fields: its MoEConfig says
    the same as moe_block's config of the shape (so the benchmark's docs may not claim the layer
    runs softmax top-k everywhere)."""
    sh = lc.QUICK_SHAPES[name]
    cfg = fields.build_config(
        base_layer.instantiate(lc.layer_template(sh, fuse=False, backend="xla")))
    want = lc.config(sh, kernel_backend="xla")
    for field in ("score_func", "num_expert_groups", "group_topk", "use_expert_bias",
                  "routed_scaling_factor", "num_experts", "top_k"):
        assert getattr(cfg, field) == getattr(want, field), (name, field)
    docs = (ROOT / "benchmarks" / "layer.py").read_text() + \
        (ROOT / "benchmarks" / "layer_cases.py").read_text()
    assert "no sigmoid" not in docs and "each\n                       shape's own routing" in docs
    perf = (ROOT / "docs" / "performance.md").read_text()
    assert "no sigmoid" not in perf and "with each shape's own routing" in perf


def test_tokens_option():
    assert layer_sweep.parse_tokens("4096,16384,65536") == [4096, 16384, 65536]
    assert layer_sweep.parse_tokens("128") == [128]
    for bad in ("0", "3000", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--tokens"):
            layer_sweep.parse_tokens(bad)
    opts = layer_report.parse_args(["--tokens", "4096,8192", "--shapes", "deepseek_ep4"])
    assert opts.tokens == [4096, 8192] and opts.shapes == ["deepseek_ep4"]
    runs = layer_sweep.runs(["qwen3"], lc.SHAPES, [4096, 65536])
    assert [(n, s.t) for n, s in runs] == [("qwen3@T4096", 4096), ("qwen3@T65536", 65536)]
    assert runs[1][1]._replace(t=16384) == lc.SHAPES["qwen3"]
    assert layer_sweep.runs(["qwen3"], lc.SHAPES, None) == [("qwen3", lc.SHAPES["qwen3"])]


def _row(shape, t, method, pct, load="balanced", pass_="fwd+bwd"):
    return dict(shape=f"{shape}@T{t}",
                tokens=t,
                load=load,
                pass_=pass_,
                method=method,
                ms=1.0,
                pct_ideal=pct)


def test_sweep_summary_and_targets_by_base_name():
    rows = [
        _row("qwen3", 4096, "cuda", 60.0),
        _row("qwen3", 16384, "cuda", 64.0),
        _row("qwen3", 65536, "cuda", 70.5),
        _row("qwen3", 4096, "xla", 10.0),
        _row("qwen3", 65536, "xla", 12.0),  # no T=16384 share: no verdict
        _row("qwen3", 4096, "cuda", 1.0, load="skewed"),  # the sweep reads balanced rows only
        _row("deepseek_ep4", 16384, "cuda", 91.0),
    ]
    summ = {(s["shape"], s["method"]): s for s in layer_sweep.summary(rows)}
    cuda = summ[("qwen3", "cuda")]
    assert cuda["pct_ideal_by_tokens"] == {4096: 60.0, 16384: 64.0, 65536: 70.5}
    assert cuda["max_points_from_ref"] == pytest.approx(6.5) and cuda["verdict"] == "FAIL"
    assert summ[("qwen3", "xla")]["verdict"] is None
    assert summ[("deepseek_ep4", "cuda")]["verdict"] == "PASS"
    text = layer_sweep.table(layer_sweep.summary(rows))
    assert "| qwen3 | fwd+bwd | cuda | 60% | 64% | 70% | 6.5 | FAIL |" in text
    layer_report.targets(rows)
    assert rows[1]["target"] == ">= 80% of ideal" and rows[1]["verdict"] == "FAIL"
    assert rows[-1]["target"] == ">= 90% of ideal" and rows[-1]["verdict"] == "PASS"


@pytest.mark.slow
def test_quick_sweep_end_to_end(tmp_path):
    """--quick --tokens: each T runs, rows carry their T and the executable's peak memory, and
    the JSON holds the sweep summary (a subprocess: XLA's fast-compile flags, as
    test_layer_bench's quick run)."""
    out = tmp_path / "sweep.json"
    env = dict(os.environ,
               XLA_FLAGS=" ".join(f"--{k}={str(v).lower()}" for k, v in FAST.items()),
               PYTHONPATH=str(ROOT))
    p = subprocess.run([
        sys.executable, "-m", "benchmarks.layer", "--quick", "--shapes", "deepseek_ep4",
        "--methods", "xla,ideal", "--no-skew", "--tokens", "64,128", "--reps", "1", "--json",
        str(out)
    ],
                       cwd=ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    ran = {(r["tokens"], r["pass_"], r["method"]) for r in res["rows"] if r.get("ms")}
    for t in (64, 128):
        for pass_ in ("fwd", "fwd+bwd"):
            assert {(t, pass_, m) for m in ("xla", "ideal")} <= ran, sorted(ran)
    assert all(r["peak_bytes"] > 0 for r in res["rows"] if r["method"] == "xla")
    summ = {(s["method"], s["pass_"]): s for s in res["sweep"]}
    assert set(summ[("xla", "fwd+bwd")]["pct_ideal_by_tokens"]) == {"64", "128"}
    assert "max points from T=16384" in p.stdout
