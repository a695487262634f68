"""The corpus the FP8 quality runs read (benchmarks.fp8_quality): this Python's sources as one
text file, made on any machine without a download, and the size of a --data path."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_corpus(path: Path, max_file_bytes: int = 200_000, min_bytes: int = 12_000_000) -> Path:
    """This Python's standard library .py files under max_file_bytes (site-packages left out),
    in sorted order, one text file at `path` (kept if it exists): a varied corpus of code that
    needs no download. Where the standard library holds less than min_bytes (a Python
    installed without its tests: 9.6 MB on the GPU machine's 3.12), the installed packages'
    .py files (site-packages, sorted) follow until it does: the issue asks for 10 MB or more."""
    if path.exists():
        return path
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if "site-packages" not in f.parts and f.stat().st_size < max_file_bytes)
    total = sum(f.stat().st_size for f in files)
    extra = []
    purelib = Path(sysconfig.get_paths()["purelib"])
    if total < min_bytes and purelib.is_dir():
        for f in sorted(purelib.rglob("*.py")):
            if total >= min_bytes:
                break
            size = f.stat().st_size
            if size < max_file_bytes:
                extra.append(f)
                total += size
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for f in files + extra:
            out.write(f.read_text(encoding="utf-8", errors="replace") + "\n")
    tmp.replace(path)
    more = f" and {len(extra)} of {purelib}" if extra else ""
    print(f"wrote {path}: {len(files)} files of {root}{more}, {path.stat().st_size:,} bytes",
          flush=True)
    return path


def data_bytes(path) -> int | None:
    """The bytes under --data (a file, or a folder's files), None without it."""
    if path is None:
        return None
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*")
                                                    if f.is_file())
