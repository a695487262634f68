"""The tokenizer copy a job directory keeps (``job_log_dir/tokenizer/``: the file and its
sha256): written once when training starts, read by resume, eval and sampling, so a job always
uses the tokenizer it trained with, even where the original file moved or changed.

``keep_in_job_dir`` writes it (atomically); ``job_tokenizer`` loads it after checking its hash
(bytes for a job that keeps none); ``check_job_tokenizer`` refuses a run whose tokenizer is not
the kept one. A half-restored copy (a file without its hash, or the reverse) is an error, never
taken for a bytes run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from experiments.tokenizer import (ByteTokenizer, Tokenizer, TokenizerError, file_sha256,
                                   load_tokenizer)

TOKENIZER_DIR = "tokenizer"  # in a job directory: the tokenizer file and tokenizer.sha256
HASH_FILE = "tokenizer.sha256"


def _kept(job_log_dir) -> Optional[tuple[Path, str]]:
    """(the tokenizer file a job directory keeps, its recorded sha256); None where the job keeps
    no tokenizer directory (a bytes run). Raises TokenizerError when the directory lacks the
    file or its hash (a half-restored copy must not pass for a bytes run)."""
    d = Path(job_log_dir) / TOKENIZER_DIR
    if not d.is_dir():
        return None
    files = [p for p in d.iterdir() if p.name != HASH_FILE]
    if not files or not (d / HASH_FILE).is_file():
        missing = "its tokenizer file" if not files else HASH_FILE
        raise TokenizerError(f"{d} lacks {missing}: the job's tokenizer copy is incomplete; "
                             "restore it")
    return files[0], (d / HASH_FILE).read_text().split()[0]


def job_tokenizer_path(job_log_dir) -> Optional[Path]:
    """The tokenizer file a job directory keeps (None: none kept, a bytes run); raises
    TokenizerError for an incomplete copy."""
    kept = _kept(job_log_dir)
    return None if kept is None else kept[0]


def job_tokenizer(job_log_dir) -> Tokenizer:
    """The tokenizer a job was trained with: the copy in its directory (bytes when it keeps
    none). Raises TokenizerError, before loading it, when the copy is incomplete or does not
    match its recorded hash."""
    kept = _kept(job_log_dir)
    if kept is None:
        return ByteTokenizer()
    p, want = kept
    got = file_sha256(p)
    if got != want:
        raise TokenizerError(f"{p} has sha256 {got[:12]}..., not the {want[:12]}... recorded in "
                             f"{p.parent / HASH_FILE}: the job's tokenizer copy was changed; "
                             "restore it")
    return load_tokenizer(str(p))


def keep_in_job_dir(job_log_dir, tok: Tokenizer) -> None:
    """Copies the tokenizer file and its hash into ``job_log_dir/tokenizer`` (atomically: a
    temporary directory renamed into place; its permissions those of ``job_log_dir``); nothing
    for bytes or when already kept."""
    if tok.path is None or job_tokenizer_path(job_log_dir) is not None:
        return
    job_log_dir = Path(job_log_dir)
    job_log_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=job_log_dir))
    os.chmod(tmp, job_log_dir.stat().st_mode & 0o7777)  # mkdtemp's 0700: the job's own mode
    shutil.copyfile(tok.path, tmp / tok.path.name)
    (tmp / HASH_FILE).write_text(f"{tok.sha256}  {tok.path.name}\n")
    os.replace(tmp, job_log_dir / TOKENIZER_DIR)


def check_job_tokenizer(job_log_dir, tok: Tokenizer) -> None:
    """Raises TokenizerError when ``job_log_dir`` was trained with another tokenizer."""
    kept = _kept(job_log_dir)
    if kept is None:
        return
    kept, want = kept
    if tok.sha256 != want:
        got = "bytes" if tok.path is None else f"{tok.path} (sha256 {tok.sha256[:12]}...)"
        raise TokenizerError(f"--job_log_dir={str(job_log_dir)!r} was trained with the tokenizer "
                             f"{kept} (sha256 {want[:12]}...), this run gives {got}; use the "
                             "same tokenizer or another --job_log_dir")
