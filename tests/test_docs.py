"""Docs and code in step: the config table, environment variables and README commands; the
layout of the tree (docs hold no results, experiments/ only its runtime, the results indexed)."""

import pathlib
import re
import subprocess

import pytest

from moe_praxis import config
from tests import testutil
from tests.testutil import long_options

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_table_matches_dataclass():
    text = (ROOT / "docs/config.md").read_text()
    table = text.split("<!-- BEGIN GENERATED TABLE -->\n", 1)[1].split("<!-- END", 1)[0]
    assert table == config.markdown_table(), (
        "docs/config.md is out of date: regenerate its table with `python -m moe_praxis.config`")


def test_every_field_is_described():
    import dataclasses

    docs = config.field_docs()
    missing = [f.name for f in dataclasses.fields(config.MoEConfig) if not docs.get(f.name)]
    assert not missing, f"MoEConfig fields without a description in its docstring: {missing}"


def _doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_documented_env_vars_are_read_by_code_and_vice_versa():
    pat = re.compile(r"\b(?:MOE_PRAXIS|MOEP)_[A-Z0-9_]+")
    documented = set()
    for f in _doc_files():
        documented |= set(pat.findall(f.read_text()))
    code = set()
    for f in testutil.repo_files({".py", ".cu", ".cc", ".h", ".cuh", ".sh"}):
        if "tests" not in f.relative_to(ROOT).parts[:1]:
            code |= set(pat.findall(f.read_text(errors="ignore")))
    assert documented <= code, f"documented but never read by the code: {documented - code}"
    assert code <= documented, f"read by the code but not documented: {code - documented}"


def test_readme_quick_start_is_the_two_make_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make run", "make test"], commands
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: install$", makefile, re.M) and re.search(r"^test: install$", makefile,
                                                                      re.M)


def test_benchmark_options_and_device_script_knobs_are_documented():
    """Every option of the kernel benchmark and every knob of the device script is in
    docs/kernels.md, and the doc names no option the benchmark lacks."""
    from benchmarks import bench_kernels

    text = (ROOT / "docs/kernels.md").read_text()
    parser_opts = long_options(bench_kernels.build_parser())
    assert parser_opts, "no options found"
    missing = sorted(o for o in parser_opts if f"`{o}" not in text)
    assert not missing, f"bench_kernels options missing from docs/kernels.md: {missing}"
    section = text.split("## Benchmark and the device script", 1)[1].split("\n## ", 1)[0]
    unknown = sorted(set(re.findall(r"`(--[a-z0-9_-]+)", section)) - parser_opts)
    assert not unknown, f"docs/kernels.md names options bench_kernels lacks: {unknown}"
    script = (ROOT / "benchmarks/kernels_device_run.sh").read_text()
    knobs = set(re.findall(r"\$\{([A-Z_]+):-", script))
    assert knobs >= {"NCU_CASES", "GG_BENCH_S"}, knobs
    for knob in knobs - {"OUT"}:
        assert knob in section, f"device-script knob {knob} is not in docs/kernels.md"


# Docs whose links point at files that moved (benchmarks/) in another change; checked once fixed.
LINKS_NOT_CHECKED: set = set()
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _markdown_files():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted((ROOT / "benchmarks").glob("**/*.md"))


def test_relative_links_resolve():
    broken = []
    for f in _markdown_files():
        if str(f.relative_to(ROOT)) in LINKS_NOT_CHECKED:
            continue
        for target in _LINK.findall(f.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            if not (f.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files: {broken}"


def test_docs_hold_documentation_only():
    """Measurements live in benchmarks/results/, not in docs/; the grouped GEMM page is its
    design and current rule, not a run log."""
    data = [p.name for p in (ROOT / "docs").iterdir() if p.suffix != ".md"]
    assert not data, f"docs/ holds non-documentation files {data}; results go to benchmarks/results/"
    lines = len((ROOT / "docs/grouped_gemm.md").read_text().splitlines())
    assert lines < 300, f"docs/grouped_gemm.md has {lines} lines; the run log is benchmarks/results/"


def test_experiments_holds_only_its_python_runtime():
    others = [p.name for p in testutil.repo_files(under="experiments") if p.suffix != ".py"]
    assert not others, (f"experiments/ holds {others}: benchmarks and their scripts go to "
                        "benchmarks/, rejected experiments to git history (benchmarks/archive.md)")


def test_results_index_lists_every_result_file():
    folder = ROOT / "benchmarks/results"
    index = (folder / "README.md").read_text()
    files = {p.name for p in folder.iterdir() if p.name != "README.md"}
    listed = set(re.findall(r"^\| `([^`]+)` \|", index, re.M))
    assert listed == files, (f"benchmarks/results/README.md lists {sorted(listed - files)} that do "
                             f"not exist and misses {sorted(files - listed)}")


def test_archive_names_commits_a_clone_has():
    """Each rejected experiment is one row of benchmarks/archive.md naming its commit, and
    every such commit is in this checkout's history (the tags it was first given were not
    pushed, so the docs name no tag)."""
    text = (ROOT / "benchmarks/archive.md").read_text()
    rows = re.findall(r"^\| `([\w.-]+)` \|.*\| `([0-9a-f]{7,40})` \|$", text, re.M)
    assert len(rows) >= 6, rows
    r = subprocess.run(["git", "rev-parse", "--is-shallow-repository"],
                       cwd=ROOT,
                       capture_output=True,
                       text=True)
    if r.returncode or r.stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history")
    for name, commit in rows:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT)
        assert r.returncode == 0, f"archive.md: {name}'s commit {commit} is not in HEAD's history"
        msg = subprocess.run(["git", "log", "-1", "--format=%s", commit],
                             cwd=ROOT,
                             capture_output=True,
                             text=True).stdout
        assert name in msg, (name, commit, msg)
    assert "git show experiment/" not in text


def _install_requires() -> list[str]:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_tools_the_docs_tell_users_to_run_are_installed():
    """`tensorboard --logdir` in the docs needs the tensorboard package (tensorboardX only
    writes event files)."""
    text = "\n".join(p.read_text() for p in _markdown_files())
    assert "tensorboard --logdir" in text
    names = [re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in _install_requires()]
    assert "tensorboard" in names, names


def test_readme_commands_run_in_the_venv():
    """Every `python -m` of the README runs .venv's Python (make installs there), and the
    README says how to use a plain `python` instead."""
    readme = (ROOT / "README.md").read_text()
    bare = [m.start() for m in re.finditer(r"(?<![\w/.])python3? -m ", readme)]
    assert not bare, [readme[i - 40:i + 40] for i in bare]
    assert ".venv/bin/python -m experiments.main" in readme
    assert "source .venv/bin/activate" in readme


def test_readme_states_the_install_and_the_run_times_the_docs_measured():
    """The README gives both the first `make run` on a fresh machine (the install) and the run
    itself, and its numbers are docs/experiments.md's measurements."""
    readme = (ROOT / "README.md").read_text()
    table = (ROOT / "docs/experiments.md").read_text().split("## Measured", 1)[1].split("\n## ")[0]
    install = re.search(r"^\| `make install` on a fresh machine[^|]*\| ([^|]*)\|$", table, re.M)
    wall = re.search(r"^\| wall time of the whole command[^|]*\| ([^|]*)\|$", table, re.M)
    assert install and wall
    section = readme.split("## Experiments", 1)[1].split("\n## ")[0]
    assert "first `make run`" in section and "`make install`" in section
    times = re.findall(r"\d+ min \d+ s|\d+ s\b", section)
    assert len(times) >= 4, times
    for t in times:
        assert t in install.group(1) or t in wall.group(1), f"README's {t} is not measured"
    assert any(t in install.group(1) for t in times) and any(t in wall.group(1) for t in times)
