"""--fdl_set / --fdl.X overrides and --fiddler calls applied to an experiment config: each path
checked against the config first (a missing field names the close matches), values parsed with
Fiddle's own parser, a value that is not a Python literal answered with flags that work pasted
into a shell (``errors.quoting_hint``)."""

from __future__ import annotations

import difflib
import re

from absl import flags

import fiddle as fdl
from fiddle._src.absl_flags import utils as fdl_utils

from configs import stack
from experiments.job import errors
from experiments.job.errors import UsageError


def _param_names(node) -> list[str]:
    if isinstance(node, fdl.Buildable):
        names = list(node.__signature_info__.parameters)
        return [n for n in names if n not in ("parent", )]
    if isinstance(node, dict):
        return [str(k) for k in node]
    return []


_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+|'[^']*'|\"[^\"]*\")\]")


def check_override_path(cfg, path: str) -> None:
    """Raises UsageError naming the first segment of ``path`` that does not exist in ``cfg``
    and the close matches at that level."""
    node, walked = cfg, []
    pos = 0
    for m in _SEGMENT.finditer(path):
        if path[pos:m.start()] not in ("", "."):
            raise UsageError(f"--fdl_set path {path!r} is malformed near {path[pos:]!r}")
        pos = m.end()
        name, index = m.group(1), m.group(2)
        where = ".".join(walked) or "<experiment config>"
        if name is not None:
            names = _param_names(node)
            if name not in names:
                close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
                hint = f"did you mean {', '.join(close)}?" if close else \
                    f"valid names: {', '.join(names) or '(none: not a config)'}"
                raise UsageError(f"--fdl_set path {path!r}: {where} has no field {name!r}; "
                                 f"{hint}")
            node = getattr(node, name) if isinstance(node, fdl.Buildable) else node[name]
            walked.append(name)
        else:
            try:
                key = int(index) if index.lstrip("-").isdigit() else index[1:-1]
                node = node[key]
            except (KeyError, IndexError, TypeError) as e:
                raise UsageError(f"--fdl_set path {path!r}: {where}[{index}] does not exist "
                                 f"({e})") from None
            walked[-1:] = [f"{walked[-1] if walked else ''}[{index}]"]
    if path[pos:]:
        raise UsageError(f"--fdl_set path {path!r} is malformed near {path[pos:]!r}")


def apply_overrides(cfg, assignments) -> None:
    """Applies ``path=value`` assignments with Fiddle's parser, after checking each path."""
    for assignment in assignments:
        if "=" not in assignment:
            raise UsageError(f"--fdl_set={assignment!r} must be path=value")
        path = assignment.split("=", 1)[0].strip()
        check_override_path(cfg, path)
        try:
            fdl_utils.set_value(cfg, assignment)
        except (ValueError, SyntaxError) as e:
            if str(e).startswith("Could not parse literal value"):
                raise UsageError(errors.quoting_hint(path, assignment.split("=", 1)[1])) from None
            raise UsageError(f"--fdl_set={assignment!r}: {e}") from None
    try:  # an override of a field the stack overwrites on its MoE template goes to the stack
        stack.redirect_overrides(cfg, [a.split("=", 1)[0].strip() for a in assignments])
    except ValueError as e:
        raise UsageError(str(e)) from None


def apply_fiddlers(cfg, source_module) -> None:
    """Applies each --fiddler (Fiddle's call syntax) to ``cfg``; a fiddler that does not
    resolve or rejects its arguments is a UsageError naming it."""
    for expression in flags.FLAGS["fiddler"].value:
        try:
            call = fdl_utils.CallExpression.parse(expression)
            fiddler = fdl_utils.resolve_function_reference(
                call.func_name, fdl_utils.ImportDottedNameDebugContext.FIDDLER, source_module, True,
                "Could not load fiddler")
            fiddler(cfg, *call.args, **call.kwargs)
        except (ValueError, TypeError, AttributeError, ImportError, SyntaxError) as e:
            names = [
                n for n in dir(source_module)
                if n.startswith("use_") and callable(getattr(source_module, n))
            ]
            raise UsageError(f"--fiddler={expression!r}: {type(e).__name__}: {e}; fiddlers in "
                             f"{source_module.__name__}: {', '.join(names)}") from e
