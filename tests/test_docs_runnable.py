"""The docs as a new user meets them: every Python block of README.md and docs/*.md runs as
written, and every repository path they (and benchmarks/archive.md, the results index) name
exists in the repository.

The blocks run in one subprocess on 8 CPU devices (the meshes the docs show need 8), each in
a fresh namespace, from a scratch directory. A block that cannot run on a CPU is marked in the
markdown by the line `<!-- not run: REASON -->` right before it; the marks are checked too.
"""

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.main_util import ROOT, main_env

NOT_RUN = re.compile(r"^<!-- not run: (.*) -->$")
# What the job, the kernel build and the device scripts write (not files of the repository).
OUTPUTS = {
    "config.json",
    "config.replaced.<n>.json",
    "metrics.jsonl",
    "summary.png",
    "env_layer.txt",
    "layer_<shapes>.log",
    "layer_breakdown_<shapes>.log",
    "moe_praxis/lib/libmoe_praxis_kernels.so",
    "benchmarks/results/layer_bench.json"  # benchmarks.layer's default --json
}
# Files of other projects the docs compare with (MaxText's, jaxlib's).
# named but not ours: other projects' files, and the file name of a user's Hugging Face tokenizer
ELSEWHERE = {"flax/moe.py", "xla/ffi/api/ffi.h", "tokenizer.json"}
REPO_EXTENSIONS = (".py", ".md", ".sh", ".json", ".jsonl", ".cu", ".cuh", ".cfg", ".toml", ".txt",
                   ".log", ".png")


def _user_docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path):
    """(line number, code, reason it is not run or None) of every ```python block."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            mark = NOT_RUN.match(lines[i - 1].strip()) if i else None
            out.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", mark and mark.group(1)))
            i = end
        i += 1
    return out


RUNNER = r"""
import json, sys, traceback
failed = []
for name, code in json.load(sys.stdin):
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(name + "\n" + traceback.format_exc(limit=4))
print(json.dumps(failed))
"""


def test_every_python_block_of_the_docs_runs_as_written(tmp_path):
    blocks = [(f"{p.relative_to(ROOT)}:{line}", code) for p in _user_docs()
              for line, code, reason in python_blocks(p) if reason is None]
    assert len(blocks) >= 5, blocks  # README (2), kernels, parallelism, praxis
    p = subprocess.run([sys.executable, "-c", RUNNER],
                       input=json.dumps(blocks),
                       cwd=tmp_path,
                       env=main_env(8),
                       capture_output=True,
                       text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)


def test_blocks_marked_not_run_say_why_and_are_rare():
    marked = [(p.name, line, reason) for p in _user_docs() for line, _, reason in python_blocks(p)
              if reason is not None]
    assert all(reason.strip() for _, _, reason in marked), marked
    assert len(marked) <= 2, marked
    # a mark that does not precede a python block would silently mark nothing
    for p in _user_docs():
        lines = p.read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                assert lines[i + 1].strip() == "```python", f"{p.name}:{i + 1}"


def _tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        pytest.skip("not a git checkout")
    files = r.stdout.split()
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    return files + sorted(folders)


def _expand(token: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", token)
    if not m:
        return [token]
    return [
        x for alt in m.group(1).split(",")
        for x in _expand(token[:m.start()] + alt + token[m.end():])
    ]


def named_paths(path: Path):
    """The repository paths a markdown file names: link targets and `code` spans that start
    at a top-level entry of the repository, lead out of it (../), or are file names with a
    repository extension (``config.py``, ``ops/swiglu.py``)."""
    for m in re.finditer(r"`([^`\s]+)`|\]\(([^)\s]+)\)", path.read_text()):
        token = (m.group(1) or m.group(2)).split("#")[0].split("::")[0].rstrip(".,:;")
        if not token or "://" in token or any(c in token for c in "()=$") or \
                token.startswith("-"):
            continue
        yield token


def test_the_docs_name_only_paths_that_exist_in_the_repository():
    tracked = _tracked()
    top = {t.split("/")[0] for t in tracked}
    docs = [*_user_docs(), ROOT / "benchmarks/archive.md", ROOT / "benchmarks/results/README.md"]
    missing = []
    for doc in docs:
        for token in named_paths(doc):
            base = token[2:] if token.startswith("./") else token
            first = base.split("/")[0]
            outside = token.startswith("../") and not (doc.parent /
                                                       token).resolve().is_relative_to(ROOT)
            repo_path = first in top and ("/" in base or first == base)
            file_name = base.endswith(REPO_EXTENSIONS) and base.rsplit("/", 1)[-1].split(".")[0]
            if not (outside or repo_path or file_name) or base in OUTPUTS | ELSEWHERE:
                continue
            for alt in _expand(base.rstrip("/")):
                pattern = re.sub(r"<[^>]*>", "*", alt)
                here = not outside and ((doc.parent / alt).exists() or (ROOT / alt).exists())
                if not (here or any(
                        fnmatch.fnmatch(t, pattern) or fnmatch.fnmatch(t, "*/" + pattern)
                        for t in tracked)):
                    missing.append(f"{doc.relative_to(ROOT)}: {token}")
    assert not missing, f"the docs name paths that are not in the repository: {missing}"
