"""Documents from local files: the first stage of the data pipeline.

``data.path`` is a file, a directory (every file under it, sorted, hidden ones left out) or a
glob. By extension:

- ``.txt`` / ``.md`` (and a named file of any other extension): one document per file;
- ``.jsonl``: one document per line, the string field ``data.text_field`` (default "text");
- ``.parquet``: one document per row of the string column ``data.text_field``.

In a directory or glob, files of other extensions are left out and counted (the startup line
names the count). Text must be UTF-8: a file that is not (or holds NUL bytes: binary, such as a
file of token ids) is refused with the file and byte offset, not decoded with replacements.
Every problem is a ``DocumentError`` of one line naming the file (and line) and the fix.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")


class DocumentError(ValueError):
    """Files that cannot be read as documents (one line, exit status 2)."""


def _listed(p: Path) -> list[Path]:
    files = []
    for root, dirs, names in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(root) / n for n in sorted(names) if not n.startswith(".")]
    return sorted(files)


def find_files(path: str) -> tuple[list[Path], int]:
    """(the document files of ``path``, how many other files were left out). Raises
    DocumentError when there are none."""
    if not path:
        raise DocumentError(f"data.path={path!r} is empty; give a file, directory or glob")
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        found = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    elif p.is_file():
        return [p.absolute()], 0
    elif p.is_dir():
        found = _listed(p)
    else:
        raise DocumentError(f"data.path={path!r}: no such file or directory; give a file, a "
                            f"directory or a glob of {', '.join(SUFFIXES)} files")
    files = [f.absolute() for f in found if f.suffix.lower() in SUFFIXES]
    if not files:
        raise DocumentError(f"data.path={path!r} holds no {', '.join(SUFFIXES)} files "
                            f"({len(found)} other files); give text files")
    return files, len(found) - len(files)


def _decode(data: bytes, where: str) -> str:
    nul = data.find(b"\0")
    if nul >= 0:
        raise DocumentError(f"{where} holds a NUL byte at offset {nul}: binary, not text (a file "
                            "of token ids?); data.path takes UTF-8 text (.txt, .md, .jsonl, "
                            ".parquet)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason}); convert "
                            "it to UTF-8 (iconv) or leave it out of data.path") from None


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in order (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            yield from _parquet(path, text_field)
            return
        data = path.read_bytes()
    except OSError as e:
        raise DocumentError(f"{path}: cannot be read ({e.strerror or e})") from None
    if suffix != ".jsonl":
        yield _decode(data, str(path))
        return
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(_decode(line, where))
        except json.JSONDecodeError as e:
            raise DocumentError(f"{where} is not JSON ({e.msg}); each line of a .jsonl file "
                                "is one JSON object") from None
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise DocumentError(f"{where} has no string field {text_field!r}; set "
                                "data.text_field to the field that holds the text")
        yield text


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DocumentError(f"{path} does not read as Parquet ({' '.join(str(e).split())[:160]})")
    if text_field not in f.schema_arrow.names:
        raise DocumentError(f"{path} has no column {text_field!r} (columns: "
                            f"{', '.join(f.schema_arrow.names)}); set data.text_field")
    for batch in f.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DocumentError(f"{path}: column {text_field!r} holds {type(text).__name__}, "
                                    "not text")
            yield text
