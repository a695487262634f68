"""Docs and code in step: the config table, environment variables and README commands."""

import pathlib
import re

from moe_praxis import config

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
    for f in ROOT.glob("**/*"):
        if f.suffix in {".py", ".cu", ".cc", ".h", ".cuh", ".sh"} and ".venv" not in f.parts \
                and "tests" not in f.relative_to(ROOT).parts[:1]:
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
    from experiments import bench_kernels

    text = (ROOT / "docs/kernels.md").read_text()
    parser_opts = {
        o
        for a in bench_kernels.build_parser()._actions
        for o in a.option_strings if o.startswith("--") and o != "--help"
    }
    assert parser_opts, "no options found"
    missing = sorted(o for o in parser_opts if f"`{o}" not in text)
    assert not missing, f"bench_kernels options missing from docs/kernels.md: {missing}"
    section = text.split("## Benchmark and the device script", 1)[1].split("\n## ", 1)[0]
    unknown = sorted(set(re.findall(r"`(--[a-z-]+)", section)) - parser_opts)
    assert not unknown, f"docs/kernels.md names options bench_kernels lacks: {unknown}"
    script = (ROOT / "experiments/kernels_device_run.sh").read_text()
    knobs = set(re.findall(r"\$\{([A-Z_]+):-", script))
    assert knobs >= {"NCU_CASES", "GG_BENCH_S"}, knobs
    for knob in knobs - {"OUT"}:
        assert knob in section, f"device-script knob {knob} is not in docs/kernels.md"
