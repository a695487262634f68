"""Experiments registered by name, like PaxML's ``experiment_registry``.

An experiment is a class with UPPERCASE knobs and an ``experiment_config()`` method, decorated
with ``@register``. Its full name is ``module.Class`` (``configs.experiments.Tiny``); any dotted
suffix of it (``experiments.Tiny``, ``Tiny``) resolves too, case-insensitively, as does the
snake_case form (``tiny``, ``small_gpu``). An unknown or ambiguous name raises ``LookupError``
naming the close matches.
"""

from __future__ import annotations

import difflib
import importlib
import re

_REGISTRY: dict[str, type] = {}
# Modules whose import registers the built-in experiments.
EXPERIMENT_MODULES = ("configs.experiments", "configs.single_gpu")


def register(cls: type) -> type:
    """Class decorator: registers ``cls`` under ``cls.__module__ + '.' + cls.__qualname__``."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"experiment {name!r} is registered twice")
    _REGISTRY[name] = cls
    return cls


def _load_builtin():
    for module in EXPERIMENT_MODULES:
        importlib.import_module(module)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[a-z0-9])(?=[A-Z][a-z])", "_", name).lower()


def all_experiments() -> dict[str, type]:
    """Full name -> class, for every registered experiment."""
    _load_builtin()
    return dict(sorted(_REGISTRY.items()))


def _aliases(full: str) -> set[str]:
    parts = full.split(".")
    out = set()
    for i in range(len(parts)):
        suffix = ".".join(parts[i:])
        out.add(suffix.lower())
        out.add(".".join(parts[i:-1] + [_snake(parts[-1])]).lower())
    return out


def get_experiment(name: str) -> type:
    """The experiment class called ``name`` (full name, dotted suffix, or snake_case)."""
    registry = all_experiments()
    if not isinstance(name, str) or not name.strip():
        raise LookupError(f"--exp={name!r} is empty; registered experiments: "
                          f"{', '.join(registry)}")
    if name in registry:
        return registry[name]
    if "." in name and name not in registry:
        module = name.rsplit(".", 1)[0]
        try:  # a user's own module: importing it registers its experiments
            importlib.import_module(module)
            registry = all_experiments()
            if name in registry:
                return registry[name]
        except ImportError:
            pass
    key = name.lower()
    hits = sorted({full for full in registry if key in _aliases(full)})
    if len(hits) == 1:
        return registry[hits[0]]
    if len(hits) > 1:
        raise LookupError(f"--exp={name!r} is ambiguous: it matches {', '.join(hits)}; "
                          "give more of the dotted name")
    candidates = {}
    for full in registry:
        for alias in _aliases(full) | {full}:
            candidates.setdefault(alias, full)
    close = difflib.get_close_matches(key, list(candidates), n=5, cutoff=0.5)
    close_full = list(dict.fromkeys(candidates[c] for c in close))
    hint = (f"did you mean {', '.join(close_full)}?" if close_full else "no close match")
    raise LookupError(f"--exp={name!r} is not a registered experiment; {hint} "
                      f"Registered: {', '.join(registry)}")


def short_name(cls: type) -> str:
    """The snake_case name used for default job directories (``Tiny`` -> ``tiny``)."""
    return _snake(cls.__name__)
