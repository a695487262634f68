"""How the main job reports a config or flag error: one line on stderr (exit status 2), with
the traceback first only when asked for (``--verbose_errors``)."""

from __future__ import annotations

import os
import shlex
import sys
import traceback

PREFIX = "experiments.main: error: "


class UsageError(ValueError):
    """A bad flag or config: the job stops with this message and exit status 2."""


class SampleError(ValueError):
    """A bad sampling request or job directory (``--mode=sample``: one line, exit status 2)."""


def one_line(e: BaseException) -> str:
    """The error's message with its line breaks and runs of spaces folded into single spaces
    (a message from Fiddle, Praxis or the OS may span lines)."""
    return " ".join(str(e).split())


def quoting_hint(path: str, value: str) -> str:
    """The error of a --fdl value that is not a Python literal, with flags that pass it as a
    string when pasted into a shell (the shell removes one level of quotes)."""

    def shell(arg: str) -> str:
        flag, rest = arg.split("=", 1)
        return f'{flag}="{rest}"' if not set(rest) & set('"$`\\!') else shlex.quote(arg)

    return (f"--fdl_set={path}={value}: {value!r} is not a Python literal; a string needs "
            f"quotes that reach Python, e.g. {shell(f'--fdl_set={path}={value!r}')} or "
            f"{shell(f'--fdl.{path}={value!r}')}")


def _unsuppressed(e: BaseException) -> BaseException:
    """``e`` with every exception it was raised from shown, even one raised ``from None``."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__suppress_context__ = False
        x = x.__cause__ or x.__context__
    return e


def report(e: BaseException, *, verbose: bool = False, file=None) -> None:
    """Prints ``e`` as ``experiments.main: error: <one line>`` on ``file`` (default stderr);
    with ``verbose``, its traceback and the exceptions it came from first."""
    file = sys.stderr if file is None else file
    if verbose:
        traceback.print_exception(_unsuppressed(e), file=file)
    print(PREFIX + one_line(e), file=file, flush=True)


def end_process_on_error(rc: int) -> int:
    """The main process's exit: after a config, flag or restore error (status 2) the process
    ends at once. Tensorstore reads still in flight after a failed restore complete during
    interpreter shutdown, where their callbacks print 'Event loop is closed' tracebacks past
    every hook (checkpoints._drop_closed_loop_errors); the one-line error has been written and
    nothing else is pending."""
    if rc == 2:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    return rc
