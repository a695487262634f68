"""The package's shape (docs/architecture.md), checked cheaply on the CPU.

(a) moe_praxis's import graph (each module's top-level imports) has no cycle.
(b) No import statement inside a function or method body in moe_praxis/, except the PEP 562
    module `__getattr__` of moe_praxis/__init__.py: it imports the Praxis layer on first access
    to `MoEFeedForward`, so that users of the functional API
    (`moe_block`, `MoEConfig`) never import praxis. A function-local import elsewhere hides a
    dependency (or a cycle) from the reader and from (a).
(c) `import moe_praxis, moe_praxis.ops` maps no kernel library and no CUDA library, in a fresh
    process: the kernel library is loaded on first use.
(d) No test, benchmark or experiment uses a private (`_x`) name of moe_praxis.ops.
(e) Tracing one moe_block calls resolve_backend exactly once (the block resolves; its ops take
    the resolved backend as it is).
(f) experiments/'s subpackages import down their order (EXPERIMENTS_LAYERS), its import graph
    has no cycle, and its entry points (main, validate, import_hf) are imported by none of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import moe_praxis as mp

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moe_praxis"
# The one allowed function-local import: (file, function) of the PEP 562 hook (module doc).
ALLOWED_LOCAL_IMPORTS = {("moe_praxis/__init__.py", "__getattr__")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(pkg.rglob("*.py"))}


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _absolute(node: ast.ImportFrom, name: str, modules: dict[str, Path]) -> str:
    """The absolute module an ImportFrom in module `name` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    if not _is_package(name, modules):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: those outside function and class
    bodies (inside module-level if / try blocks too)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo += child.body if isinstance(child, ast.ExceptHandler) else [child]


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module of ``pkg`` (moe_praxis) -> the modules of ``pkg`` its top-level imports name."""
    modules = _modules(pkg)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                mod = _absolute(node, name, modules)
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    """The check can fail: a graph with a cycle is reported, one without is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    assert "moe_praxis.ops.backend" in graph["moe_praxis.ops.grouped_gemm"]
    assert "moe_praxis.ops._library" in graph["moe_praxis.ops.backend"]


def test_package_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle in moe_praxis: {' -> '.join(cycle)}"


def local_imports(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, statement) of every import inside a function body of `path`, and of
    every importlib.import_module / __import__ of a moe_praxis module there."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = getattr(child, "name", "<lambda>")
            if func and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((func, child.lineno, ast.unparse(child)))
            if func and isinstance(child, ast.Call):
                callee = ast.unparse(child.func)
                arg = child.args[0] if child.args else None
                if (callee.endswith("import_module") or callee == "__import__") and isinstance(
                        arg, ast.Constant) and str(arg.value).startswith("moe_praxis"):
                    found.append((func, child.lineno, ast.unparse(child)))
            walk(child, inner)

    walk(tree, None)
    return found


def test_local_import_finder_finds_a_planted_one(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    import json\n    return json\n\n"
                   "class C:\n    def g(self):\n        from a import b\n"
                   "        return importlib.import_module('moe_praxis.ops')\n")
    assert [(f, line) for f, line, _ in local_imports(src)] == [("f", 4), ("g", 9), ("g", 10)]


def test_no_function_local_imports_in_the_package():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for func, line, stmt in local_imports(path):
            if (rel, func) not in ALLOWED_LOCAL_IMPORTS:
                bad.append(f"{rel}:{line} in {func}(): {stmt}")
    assert not bad, "function-local imports (import at module top instead):\n" + "\n".join(bad)


_FRESH_IMPORT = r"""
import json, os, sys

def mapped():
    return {line.split()[-1] for line in open("/proc/self/maps") if len(line.split()) >= 6}

import jax  # what JAX itself maps on import (a CUDA jaxlib may map CUDA libraries) is not ours
before = mapped()
import moe_praxis, moe_praxis.ops
from moe_praxis.ops import backend
markers = ("libmoe_praxis_kernels", "libcuda.so", "libcudart", "libcublas", "libnvrtc",
           "libcudnn", "libnccl")
print(json.dumps({
    "loaded": sorted(p for p in mapped() - before if any(m in os.path.basename(p) for m in markers)),
    "library_state": backend.library_state(),
    "device_queried": backend.device_query.cache_info().currsize,
    "praxis_imported": "praxis" in sys.modules,
}))
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_import_loads_no_shared_library():
    p = subprocess.run([sys.executable, "-c", _FRESH_IMPORT],
                       capture_output=True,
                       text=True,
                       cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], f"import moe_praxis mapped {out['loaded']}"
    assert out["library_state"]["attempted"] is False, out["library_state"]
    assert out["device_queried"] == 0, "import moe_praxis queried the CUDA driver"
    assert out["praxis_imported"] is False, "import moe_praxis imported praxis"


# ------------------------------------------------ (d) no private names of moe_praxis.ops outside


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_ops_path(path: str) -> bool:
    parts = path.split(".")
    if parts[:2] != ["moe_praxis", "ops"]:
        return False
    return any(_is_private(p) for p in parts[2:])


def private_ops_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every use in `path` of a private name of moe_praxis.ops: imported,
    reached as an attribute of a name bound to moe_praxis (or an ops module), imported by
    importlib, or set with monkeypatch.setattr."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> dotted path it is bound to
    found = []

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") \
                and node.args and isinstance(node.args[0], ast.Constant):
            return str(node.args[0].value)
        return None

    for node in ast.walk(tree):  # bindings first (any scope: tests import inside functions)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("moe_praxis"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "moe_praxis"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_praxis"):
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            value = dotted(node.value)
            if value and value.startswith("moe_praxis"):
                aliases[node.targets[0].id] = value
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_praxis.ops"):
            for a in node.names:
                if _private_ops_path(f"{node.module}.{a.name}"):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, ast.unparse(node)) for a in node.names
                      if _private_ops_path(a.name)]
        elif isinstance(node, ast.Attribute):
            full = dotted(node)
            if full and _private_ops_path(full) and not _private_ops_path(dotted(node.value) or ""):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            args = node.args
            if callee.endswith("import_module") and args and isinstance(args[0], ast.Constant):
                if _private_ops_path(str(args[0].value)):
                    found.append((node.lineno, ast.unparse(node)))
            if callee.endswith("setattr") and len(args) >= 2 and isinstance(
                    args[1], ast.Constant) and isinstance(args[1].value, str):
                target = dotted(args[0])
                if target and _private_ops_path(f"{target}.{args[1].value}"):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_private_name_finder_finds_planted_uses(tmp_path):
    src = tmp_path / "t.py"
    src.write_text("import importlib\nfrom moe_praxis import ops\n"
                   "from moe_praxis.ops import _library\n"
                   "from moe_praxis.ops.grouped_gemm import _run, grouped_gemm\n"
                   "gg = importlib.import_module('moe_praxis.ops.grouped_gemm')\n"
                   "x = gg._warned\ny = ops.backend._warned\nz = gg.TILE_CONFIGS\n"
                   "def t(monkeypatch):\n    monkeypatch.setattr(ops.backend, '_state', 1)\n")
    assert [line for line, _ in private_ops_uses(src)] == [3, 4, 6, 7, 10]


def test_tests_and_benchmarks_use_only_public_ops_names():
    bad = []
    for folder in ("tests", "benchmarks", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == Path(__file__).resolve():
                continue
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line}: {what}" for line, what in private_ops_uses(path)]
    assert not bad, "private names of moe_praxis.ops used outside the package:\n" + "\n".join(bad)


# ------------------------------------------------------ (e) one resolve_backend per moe_block


def _count_resolve_backend(monkeypatch) -> list:
    """Replaces resolve_backend in every moe_praxis module that holds it with a counter."""
    from moe_praxis.ops import backend

    original = backend.resolve_backend
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("moe_praxis") and getattr(module, "resolve_backend", None) is original:
            monkeypatch.setattr(module, "resolve_backend", counting)
    return calls


@pytest.mark.parametrize("kernel_backend", ["auto", "xla", "cuda"])
def test_resolve_backend_is_called_once_per_block(kernel_backend, monkeypatch):
    """'cuda' runs with the CUDA status forced on (the CPU traces the ops' CUDA paths, whose
    FFI branches lower only for CUDA): the ops given the block's resolved 'cuda' must not
    resolve again."""
    from moe_praxis.ops import backend

    if kernel_backend == "cuda":
        monkeypatch.setattr(backend, "cuda_status", lambda op="": (True, "forced by the test"))
    calls = _count_resolve_backend(monkeypatch)
    cfg = mp.MoEConfig(d_model=16,
                       d_ff=32,
                       num_experts=4,
                       top_k=2,
                       kernel_backend=kernel_backend,
                       fuse_gate_up=kernel_backend == "cuda")
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jnp.ones((2, 8, 16), jnp.float32)

    def loss(p, x):
        out = mp.moe_block(p, x, cfg)
        return jnp.sum(out.y) + out.aux_loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float32 grouped GEMM's fallback warning
        jax.eval_shape(jax.grad(loss), params, x)
    assert len(calls) == 1, f"resolve_backend called {len(calls)} times: {calls}"


# ------------------------------------------------ (f) experiments/: subpackages that import down

# experiments/'s subpackages, bottom first: each imports only those before it; the entry points
# (experiments.main, .validate, .import_hf) sit on top of them all.
EXPERIMENTS_LAYERS = ("tokenizer", "data", "train", "job", "sample", "hf")


def _experiments_layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in EXPERIMENTS_LAYERS:
        return EXPERIMENTS_LAYERS.index(parts[1])
    return len(EXPERIMENTS_LAYERS)  # experiments itself and its entry modules


def test_experiments_subpackages_import_down():
    """Every import in experiments/ (top-level or not) names a module of its own subpackage or
    of one below it (an entry point only by another entry point)."""
    graph = import_graph(ROOT / "experiments")
    assert find_cycle(graph) is None, f"import cycle in experiments: {find_cycle(graph)}"
    modules = _modules(ROOT / "experiments")
    assert {m.split(".")[1] for m in modules if m.count(".") >= 2} == set(EXPERIMENTS_LAYERS)
    upward = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _absolute(node, name, modules)
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
                ]
            else:
                continue
            upward += [
                f"{name} imports {target}" for target in targets
                if target in modules and _experiments_layer(target) > _experiments_layer(name)
            ]
    assert not upward, f"imports up experiments/' layers {EXPERIMENTS_LAYERS}:\n" + "\n".join(
        upward)


def test_experiments_ask_the_layer_for_fp8_weights():
    """The runner reaches no FP8 internals (moe_praxis.ops.fp8, moe_praxis.praxis.fp8_params):
    it asks the layer's public entry, moe_praxis.step_fp8_weights."""
    inside = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else
                [f"{node.module}.{a.name}"
                 for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else [])
            inside += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                if n.startswith(("moe_praxis.ops.fp8", "moe_praxis.praxis.fp8_params"))
            ]
    assert not inside, "experiments/ imports FP8 internals:\n" + "\n".join(inside)
