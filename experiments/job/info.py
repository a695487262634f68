"""What the job says instead of running: the registered experiments (``--list_experiments``)
and one experiment's help (``--fdl_help``): its flags and every field of its config, each a
path that ``--fdl.PATH=VALUE`` can set."""

from __future__ import annotations

import fiddle as fdl
from absl import flags
from fiddle import printing as fdl_printing

from configs import registry, stack


def _summary(doc) -> str:
    """A docstring's first paragraph on one line."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def experiments_table() -> str:
    """One line per registered experiment: its --exp name, full name and docstring's first
    paragraph."""
    rows = [(registry.short_name(cls), full, _summary(cls.__doc__))
            for full, cls in registry.all_experiments().items()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        "Registered experiments (--exp=NAME or --fdl_config=NAME; case, _ and - do not "
        "count; --exp also takes the full name or a dotted suffix of it):"
    ]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def _flags_help(flag_name: str) -> str:
    """absl's help of every flag defined by the module that defines ``flag_name``."""
    fv = flags.FLAGS
    module = fv.find_module_defining_flag(flag_name)
    return fv.module_help(module) if module else ""


def help_text(cfg: fdl.Buildable, name: str, cls=None) -> str:
    """The help of one experiment: ``cls``'s docstring (a registered experiment), the flags of
    experiments.main and Fiddle's, and the config's fields with their values (after any
    --fiddler and --fdl overrides)."""
    title = f"experiment {name}" + (f" ({cls.__module__}.{cls.__qualname__})" if cls else "")
    out = [title]
    doc = (cls.__doc__ or "").strip() if cls is not None else ""
    if doc:
        out += ["  " + line.strip() for line in doc.splitlines()]
    out += [
        "",
        _flags_help("exp"), "",
        _flags_help("fdl_config"), "", "Config fields (set any with --fdl.PATH=VALUE; values are "
        "Python literals; '# set by the stack' marks a field of the MoE template that the stack "
        "overwrites, with the value the layers get and where it is set):",
        _mark_stack_fields(cfg, fdl_printing.as_str_flattened(cfg, include_types=False))
    ]
    return "\n".join(out)


def _mark_stack_fields(cfg, flat: str) -> str:
    """``flat`` (one ``path = value`` a line) with each template field the stack overwrites
    marked ``# set by the stack: VALUE from WHERE``."""
    model = getattr(cfg, "model", None)
    try:
        marks = stack.template_fields_set_by_stack(model) if model is not None else {}
    except (AttributeError, TypeError, ValueError):  # not a TransformerLm of a known stack
        marks = {}
    lines = []
    for line in flat.splitlines():
        path = line.split(" = ", 1)[0]
        if path in marks:
            value, where = marks[path]
            line += f"  # set by the stack: {value!r} from {where}"
        lines.append(line)
    return "\n".join(lines)


def answered(config_from_flags, default_exp: str) -> bool:
    """Prints what --list_experiments or --fdl_help asks for (``config_from_flags``: the main's
    (config, name) from the flags, overrides applied); True when one of them did, and the job
    then ends without running."""
    fv = flags.FLAGS
    if fv["list_experiments"].value:
        print(experiments_table(), flush=True)
        return True
    if not fv["fdl_help"].value:
        return False
    # Fiddle's create_buildable_from_flags would print its own help and then build and run.
    fv["fdl_help"].value = False
    cfg, name = config_from_flags()
    cls = None
    if not (fv["fdl_config"].value or fv["fdl_config_file"].value):
        cls = registry.get_experiment(fv["exp"].value or default_exp)
    print(help_text(cfg, name, cls), flush=True)
    return True
