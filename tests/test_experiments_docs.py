"""Experiments' docs kept in step with the code: docs/experiments.md lists every flag of
experiments.main with its default, every config field with its default, every registered
experiment and every knob of the experiment classes."""

import dataclasses
import re
from pathlib import Path

import pytest

from absl import flags

from configs import base, experiments, registry
from experiments import main as main_lib  # noqa: F401  (defines the flags read here)

ROOT = Path(__file__).resolve().parents[1]

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
        _check_row(doc, name)
    for name in ("fdl_config", "fdl_config_file", "fdl_set", "fiddler"):
        assert name in flags.FLAGS and f"`--{name}" in doc


def test_docs_list_every_sample_flag_with_its_default():
    """--mode=sample's flags (every flag experiments.sample.cli defines) and nothing else in
    the table of "Generating text"."""
    doc = _doc()
    names = [f.name for f in flags.FLAGS.get_flags_for_module("experiments.sample.cli")]
    assert {"prompt", "max_new_tokens", "temperature", "output_json"} <= set(names)
    for name in names:
        _check_row(doc, name)
    section = doc.split("## Generating text")[1].split("\n## ")[0]
    assert set(re.findall(r"^\| `--(\w+)`", section, re.M)) == set(names)


def _check_row(doc, name):
    """--name has a row in a flag table of ``doc`` whose default column is the flag's."""
    assert f"`--{name}" in doc, name
    default = flags.FLAGS[name].default
    row = re.search(rf"^\| `--{name}[^|]*\| ([^|]*)\|", doc, re.M)
    assert row, f"--{name} has no row in the flag table"
    assert row.group(1).strip() == f"`{default!r}`" if default is not None else \
        row.group(1).strip() == "`None`", (name, row.group(1))


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


def test_docs_list_every_knob():
    doc = _doc()
    knobs = [k for k in vars(experiments.LanguageModel) if k.isupper()]
    assert len(knobs) > 30
    listed = set(
        re.findall(r"\b[A-Z][A-Z0-9_]+\b",
                   doc.split("Knobs (class attributes")[1].split("The model (")[0]))
    assert listed == set(knobs), (set(knobs) - listed, listed - set(knobs))


def test_docs_list_the_fdl_config_functions():
    """The --fdl_config row names the functions of configs/experiments.py, every one."""
    row = next(line for line in _doc().splitlines() if line.startswith("| `--fdl_config=NAME`"))
    listed = re.findall(r"`(\w+)`", row.split("(", 1)[1].split(":", 1)[0])
    assert sorted(listed) == registry.config_functions(experiments), row
