"""Experiments registered by name, like PaxML's ``experiment_registry``.

An experiment is a class with UPPERCASE knobs and an ``experiment_config()`` method, decorated
with ``@register`` (or ``@register(name="deepseek_v3")``). Its full name is ``module.Class``
(``configs.experiments.Tiny``); its name is the one given to ``register`` or else the class name
in snake_case (``tiny``, ``small_gpu``): ``--list_experiments`` and the default job directory
use it. One rule matches what users type: case, ``_`` and ``-`` do not count, so
``deepseek_v3``, ``deep_seek_v3``, ``DeepSeekV3`` and ``deepseek-v3`` are the same name; the
full name and any dotted suffix of it (``experiments.Tiny``) resolve too. An unknown or
ambiguous name raises ``LookupError`` in one line listing the valid names.
"""

from __future__ import annotations

import difflib
import importlib
import re

_REGISTRY: dict[str, type] = {}
_NAMES: dict[type, str] = {}  # class -> the name users see
# Modules whose import registers the built-in experiments.
EXPERIMENT_MODULES = ("configs.experiments", "configs.single_gpu")


def register(cls: type | None = None, *, name: str | None = None):
    """Class decorator: registers ``cls`` under ``cls.__module__ + '.' + cls.__qualname__``,
    with ``name`` (default: the class name in snake_case) as the name users see."""
    if cls is None:
        return lambda c: register(c, name=name)
    full = f"{cls.__module__}.{cls.__qualname__}"
    if full in _REGISTRY and _REGISTRY[full] is not cls:
        raise ValueError(f"experiment {full!r} is registered twice")
    _REGISTRY[full] = cls
    _NAMES[cls] = name or _snake(cls.__name__)
    return cls


def normalize(name: str) -> str:
    """The matching key of a name: lowercase, without '_' and '-' (``Deep_Seek-V3`` ->
    ``deepseekv3``)."""
    return re.sub(r"[_-]", "", name).lower()


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
    """The normalized keys that name ``full``: its dotted suffixes, each with the class part
    also as the registered name."""
    parts = full.split(".")
    names = {parts[-1], _NAMES.get(_REGISTRY.get(full), parts[-1])}
    return {normalize(".".join(parts[i:-1] + [n])) for i in range(len(parts)) for n in names}


def _valid(registry) -> str:
    return ", ".join(sorted(short_name(cls) for cls in registry.values()))


def get_experiment(name: str) -> type:
    """The experiment class called ``name`` (its name, full name or a dotted suffix; case,
    ``_`` and ``-`` do not count)."""
    registry = all_experiments()
    if not isinstance(name, str) or not name.strip():
        raise LookupError(f"--exp={name!r} is empty; registered experiments: {_valid(registry)}")
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
    key = normalize(name)
    hits = sorted({full for full in registry if key in _aliases(full)})
    if len(hits) == 1:
        return registry[hits[0]]
    if len(hits) > 1:
        raise LookupError(f"--exp={name!r} is ambiguous: it matches {', '.join(hits)}; "
                          "give more of the dotted name")
    candidates = {}
    for full in registry:
        for alias in _aliases(full):
            candidates.setdefault(alias, full)
    close = difflib.get_close_matches(key, list(candidates), n=5, cutoff=0.5)
    close_full = list(dict.fromkeys(candidates[c] for c in close))
    hint = (f"did you mean {', '.join(f'{short_name(registry[f])} ({f})' for f in close_full)}?"
            if close_full else "no close match.")
    raise LookupError(f"--exp={name!r} is not a registered experiment; {hint} Registered: "
                      f"{_valid(registry)}")


def short_name(cls: type) -> str:
    """The name users see (``--list_experiments``, the default job directory): the one given
    to ``register``, else the class name in snake_case (``Tiny`` -> ``tiny``)."""
    return _NAMES.get(cls) or _snake(cls.__name__)


def config_function(cls: type):
    """The ``--fdl_config=NAME`` function of the experiment ``cls``: no arguments, returns
    ``cls().experiment_config()``; named as the experiment (``short_name``), in its module."""
    name = short_name(cls)

    def config():
        return cls().experiment_config()

    config.__name__ = config.__qualname__ = name
    config.__module__ = cls.__module__
    config.__doc__ = f"The {cls.__name__} experiment (same as --exp={name})."
    config.experiment = cls
    return config


def define_config_functions(namespace: dict) -> list[str]:
    """Defines in ``namespace`` (a module's ``globals()``, called at its end) the
    ``--fdl_config`` function of every experiment that module registered (``config_function``).
    Returns their names; a name the module already binds is an error, not overwritten."""
    module = namespace["__name__"]
    names = []
    for cls in [c for c in _REGISTRY.values() if c.__module__ == module]:
        name = short_name(cls)
        if name in namespace:
            raise ValueError(
                f"{module}.{name} is already defined; the experiment {cls.__name__}'s "
                "--fdl_config function would replace it: register it under another name")
        namespace[name] = config_function(cls)
        names.append(name)
    return names


def config_functions(module) -> list[str]:
    """The config functions of ``module`` (``--fdl_config=NAME``): those
    ``define_config_functions`` made there, one per experiment it registers."""
    return sorted(n for n in dir(module)
                  if getattr(getattr(module, n), "experiment", None) is not None
                  and getattr(module, n).__module__ == module.__name__)


def builtin_config_functions() -> list[str]:
    """``--fdl_config`` names of every built-in experiment module: those of
    ``configs.experiments`` as they are, the others' as ``module.function``."""
    _load_builtin()
    names = []
    for module in EXPERIMENT_MODULES:
        mod = importlib.import_module(module)
        prefix = "" if module == EXPERIMENT_MODULES[0] else module + "."
        names += [prefix + n for n in config_functions(mod)]
    return names


def function_name(name: str, names) -> str:
    """The one of ``names`` whose function name ``name`` normalizes to (``deep_seek_v3`` ->
    ``deepseek_v3``, ``qwen3_moe_gpu`` -> ``configs.single_gpu.qwen3_moe_gpu``), else ``name`` (a dotted ``module.function`` or an unknown name) unchanged."""
    hits = [
        n for n in names if "." not in name and normalize(n.rsplit(".", 1)[-1]) == normalize(name)
    ]
    return hits[0] if len(hits) == 1 else name
