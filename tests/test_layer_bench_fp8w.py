"""The layer benchmark's FP8 rows per optimizer step (benchmarks/layer_fp8w.py, --microbatches)
as arithmetic: the amortized time and the per-step FP8 targets. Speed itself is the benchmark's
output on a GPU, never asserted here."""

import random

import pytest

from benchmarks import layer_fp8w, layer_report
from tests.testutil import seed as _seed


def _unit(shape, cuda, pre, quant, pass_="fwd+bwd", load="balanced"):
    base = dict(shape=shape, load=load, pass_=pass_)
    return [
        dict(base, method="cuda", ms=cuda),
        dict(base, method=layer_fp8w.PREQUANTIZED, ms=pre),
        dict(base, method=layer_fp8w.QUANTIZE, ms=quant)
    ]


def test_amortized_rows_add_the_quantization_once_per_step():
    rnd = random.Random(_seed())
    cuda, pre, quant = (rnd.uniform(1, 50) for _ in range(3))
    rows = layer_fp8w.amortized(_unit("qwen3", cuda, pre, quant), [1, 8, 3])
    assert [r["method"] for r in rows] == ["cuda+fp8 @1", "cuda+fp8 @8", "cuda+fp8 @3"]
    for r, n in zip(rows, (1, 8, 3)):
        assert r["ms"] == pytest.approx(pre + quant / n, rel=1e-12)
        assert r["x_cuda"] == pytest.approx(cuda / (pre + quant / n), rel=1e-12)
    # nothing derived where a part did not run
    assert layer_fp8w.amortized(_unit("qwen3", cuda, pre, None), [1]) == []


def test_below_the_rows_per_expert_the_row_is_the_bf16_layer():
    """fp8_gemms='auto' makes no FP8 form where it would serve fewer than FORM_MIN_ROWS rows per
    expert: 1024 rows a call, so @1 is 'cuda''s time (x1.0) and @2 (2048 rows) the amortized
    FP8 step; at 4096 rows a call both are FP8."""
    rnd = random.Random(_seed())
    cuda, pre, quant = (rnd.uniform(1, 50) for _ in range(3))
    unit = _unit("qwen3", cuda, pre, quant)
    one, two = layer_fp8w.amortized(unit, [1, 2], rows_per_expert=1024)
    assert (one["ms"], one["x_cuda"], one["fp8_form"]) == (cuda, 1.0, False)
    assert two["ms"] == pytest.approx(pre + quant / 2, rel=1e-12) and two["fp8_form"]
    rows = layer_fp8w.amortized(unit, [1, 2], rows_per_expert=4096)
    assert [r["fp8_form"] for r in rows] == [True, True]


@pytest.mark.parametrize("shape,n,least", [("mixtral", 1, 1.35), ("qwen3", 1, 1.0),
                                           ("deepseek", 1, 1.0), ("deepseek", 8, 1.25),
                                           ("qwen3", 8, 1.10)])
def test_targets_of_issue_36(shape, n, least):
    cuda = 10.0
    # quant 0: x_cuda = cuda / pre exactly; just above and just below the bound
    for x, verdict in ((least * 1.01, "PASS"), (least * 0.99, "FAIL")):
        rows = layer_fp8w.amortized(_unit(shape, cuda, cuda / x, 0.0), [n])
        layer_report.targets(rows)
        assert rows[0]["verdict"] == verdict, (shape, n, x)
    # no target on the skewed load, the forward alone, or Mixtral at 8
    for kw in (dict(load="skewed"), dict(pass_="fwd")):
        rows = layer_fp8w.amortized(_unit(shape, cuda, 1.0, 0.0, **kw), [n])
        assert layer_report.targets(rows) == []
    assert layer_report.targets(layer_fp8w.amortized(_unit("mixtral", 1, 1, 0), [8])) == []


def test_microbatches_option_needs_positive_ints():
    assert layer_report.parse_args([]).microbatches == [1, 8]
    assert layer_report.parse_args(["--microbatches", "2,4"]).microbatches == [2, 4]
    with pytest.raises(SystemExit):
        layer_report.parse_args(["--microbatches", "0,8"])
