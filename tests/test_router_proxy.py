"""benchmarks.router_proxy: the CPU stand-in keeps the Mixtral-like preset's router width and
schedule; its report reads job directories' metrics and computes entropy windows and seed
spreads (checked against direct computations on fresh random records)."""

import json

import numpy as np
import pytest

from benchmarks import router_proxy
from configs.single_gpu import MixtralMoeGpu


def test_the_proxy_keeps_the_presets_router_width_and_schedule():
    p, g = router_proxy.MixtralRouterProxy, MixtralMoeGpu
    for knob in ("MODEL_DIMS", "NUM_EXPERTS", "TOP_K", "NUM_LAYERS", "LEARNING_RATE",
                 "WARMUP_STEPS", "AUX_LOSS_COEFF", "AUX_LOSS_TYPE", "ROUTER_INIT_SCALE"):
        assert getattr(p, knob) == getattr(g, knob), knob
    assert p.MOE_HIDDEN_DIMS < g.MOE_HIDDEN_DIMS and p.SEQ_LEN * p.BATCH_SIZE == 1024
    cfg = router_proxy.mixtral_router_proxy()
    assert cfg.model.model_dims == 4096
    assert router_proxy.mixtral_router_proxy.experiment is router_proxy.MixtralRouterProxy


def _write_run(path, rng, steps, evals, layers=2):
    path.mkdir()
    recs, truth = [], {}
    for s in evals:
        recs.append({"kind": "eval", "step": s, "heldout_loss": float(rng.uniform(1, 5))})
    for s in range(1, steps + 1):
        per = rng.uniform(0, np.log(8), size=layers)
        truth[s] = per
        recs.append({
            "kind": "train",
            "step": s,
            "xent": float(rng.uniform(1, 5)),
            "router_entropy": float(per.mean()),
            **{
                f"router_entropy_layer_{l}": float(per[l])
                for l in range(layers)
            }
        })
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    xent = {r["step"]: r["xent"] for r in recs if r["kind"] == "train"}
    return {r["step"]: r["heldout_loss"] for r in recs if r["kind"] == "eval"}, (truth, xent)


def test_report_windows_and_seed_spreads(tmp_path, capsys):
    rng = np.random.default_rng()
    evals = [0, 5, 10]
    held, truth = {}, {}
    for name in ("base", "base.s1", "scaled", "scaled.s1"):
        held[name], truth[name] = _write_run(tmp_path / name, rng, 10, evals)
    out = tmp_path / "r.json"
    assert router_proxy.main([f"{n}={tmp_path / n}" for n in held] + ["--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["steps"] == evals
    for name in held:
        entropy, xent = truth[name]
        for s, lo in ((5, 1), (10, 6)):
            np.testing.assert_allclose(got["train_xent_windows"][name][str(s)],
                                       np.mean([xent[t] for t in range(lo, s + 1)]),
                                       rtol=1e-9)
            w = got["router_entropy_windows"][name][str(s)]
            want = np.mean([entropy[t] for t in range(lo, s + 1)], axis=0)
            np.testing.assert_allclose([w["router_entropy_layer_0"], w["router_entropy_layer_1"]],
                                       want,
                                       rtol=1e-9)
            np.testing.assert_allclose(w["router_entropy"], want.mean(), rtol=1e-9)
    # two groups of seeds: base and base.s1, scaled and scaled.s1
    assert set(got["seed_spreads"]) == {"base", "scaled"}
    # a run at seed 1 is read against base.s1, the others against base
    assert got["gap_references"] == {"base.s1": "base", "scaled": "base", "scaled.s1": "base.s1"}
    for name, ref in got["gap_references"].items():
        for s in evals:
            np.testing.assert_allclose(got["heldout_gaps"][name][str(s)],
                                       held[name][s] / held[ref][s] - 1,
                                       rtol=1e-9)
        np.testing.assert_allclose(
            got["train_xent_gaps"][name]["10"],
            got["train_xent_windows"][name]["10"] / got["train_xent_windows"][ref]["10"] - 1,
            rtol=1e-9)
    for s in evals:
        a, b = held["base"][s], held["base.s1"][s]
        np.testing.assert_allclose(got["seed_spreads"]["base"][str(s)],
                                   abs(a - b) / ((a + b) / 2),
                                   rtol=1e-9)
    text = capsys.readouterr().out
    assert "spread of base over its seeds" in text
    means = {n: got["train_xent_windows"][n]["10"] for n in held}
    assert (f"| 6-10 | {means['base']:.4f} | {means['base.s1']:.4f} "
            f"({means['base.s1'] / means['base'] - 1:+.2%}) |") in text


def test_report_errors_name_the_bad_run(tmp_path):
    with pytest.raises(SystemExit):
        router_proxy.main(["base"])
    with pytest.raises(SystemExit, match=r"missing=.*no metrics.jsonl"):
        router_proxy.main([f"missing={tmp_path / 'nothing'}"])
