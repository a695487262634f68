"""Experiments' data and metrics: the byte-level datasets (synthetic, pydoc, text files and
directories) as a function of seed and step, the expert load read from the step's summaries,
and the metrics file with its summary plot. In-process and fast."""

import json
import math

import numpy as np
import pytest

from configs import base
from experiments import data as data_lib
from experiments.train import metrics

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
    (tmp_path / "d" / "sub" / "b.md").write_bytes(b"B" * 300)
    (tmp_path / "d" / ".hidden.txt").write_bytes(b"H" * 300)
    (tmp_path / "d" / "sub" / "c.bin").write_bytes(b"C\0" * 300)  # not a text suffix: counted
    cfg = _cfg(path=str(tmp_path / "d"), heldout_fraction=0.5, cache_dir=str(tmp_path / "cache"))
    assert cfg.resolved_source == "text"
    ds = data_lib.load_dataset(cfg)
    assert bytes(np.asarray(ds.corpus.tokens, np.uint8)) == b"A" * 300 + b"B" * 300
    assert ds.info["documents"] == 2 and ds.info["skipped_files"] == 1
    assert ds.info["tokenizer"] == "bytes" and ds.cut == 300
    (tmp_path / "f.txt").write_bytes(bytes(range(256)) * 2)  # binary where text was expected
    with pytest.raises(ValueError, match=r"f\.txt holds a NUL byte at offset 0"):
        data_lib.load_dataset(_cfg(path=str(tmp_path / "f.txt"), cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="no such file or directory"):
        data_lib.load_dataset(_cfg(path=str(tmp_path / "nope")))
    (tmp_path / "small.txt").write_bytes(b"x" * 30)
    with pytest.raises(ValueError, match=r"leaves \d+ tokens in the held-out split"):
        data_lib.load_dataset(_cfg(path=str(tmp_path / "small.txt"), cache_dir=str(tmp_path)))


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


def test_router_entropy_by_layer_from_summaries_stacked_and_repeated():
    rng = np.random.default_rng(1)
    ent = rng.uniform(0.0, np.log(8), size=4)  # [L=4], fresh values
    stacked = {
        "transformer": {
            f"x_layers_{l}": {
                "ff_layer": {
                    "moe_router_entropy_scalar": ent[l],
                    "moe_z_loss_scalar": 9.0,  # another summary: not read
                }
            }
            for l in (1, 3)
        }
    }
    got = np.asarray(metrics.router_entropy_by_layer(stacked, 4))
    np.testing.assert_allclose(got[[1, 3]], ent[[1, 3]], rtol=1e-6)
    assert np.all(np.isnan(got[[0, 2]]))  # dense layers
    # The repeated stack: two layers a block, two repeats, after one dense layer.
    repeated = {
        "transformer": {
            "repeat": {
                "sub": {
                    f"x_layers_{i}": {
                        "ff_layer": {
                            "moe_router_entropy_scalar": ent[[i, 2 + i]].reshape(2, 1)
                        }
                    }
                    for i in (0, 1)
                }
            }
        }
    }
    got = np.asarray(metrics.router_entropy_by_layer(repeated, 5, 2, 1))
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], ent, rtol=1e-6)
    assert metrics.router_entropy_by_layer({"a": {"moe_aux_loss_scalar": 1.0}}, 2) is None
    # the run's router_entropy is the layers' mean
    mean = metrics.moe_scalars(repeated)["router_entropy"]
    np.testing.assert_allclose(float(mean), ent.mean(), rtol=1e-6)


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
