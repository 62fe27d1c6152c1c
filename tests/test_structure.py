"""The house rules that keep the code changeable, checked on the source itself.

- no import circle among the modules of a package (module-level, function-level and TYPE_CHECKING
  imports all count: a lazy import is still a dependency);
- the adapters use only the engine's public names (no ``layerckpt._private`` module);
- the entry modules read as lists of named steps: no function over 60 lines.
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {
    "layerckpt": os.path.join(ROOT, "core", "layerckpt"),
    "lightning_layerckpt": os.path.join(ROOT, "lightning_layerckpt"),
    "accelerate_layerckpt": os.path.join(ROOT, "accelerate_layerckpt"),
    "transformers_layerckpt": os.path.join(ROOT, "transformers_layerckpt"),
}
ADAPTERS = ("lightning_layerckpt", "accelerate_layerckpt", "transformers_layerckpt")
SHORT = [
    "core/layerckpt/checkpointer.py", "core/layerckpt/restore.py", "core/layerckpt/_plan.py",
    "core/layerckpt/config.py", "lightning_layerckpt/callback.py", "accelerate_layerckpt/plugin.py",
]
MAX_LINES = 60


def _modules() -> Dict[str, str]:
    """Dotted module name -> source file, for every package of the distribution."""
    out = {}
    for pkg, base in PACKAGES.items():
        if not os.path.isdir(base):
            continue
        for d, _, files in os.walk(base):
            if "__pycache__" in d:
                continue
            rel = os.path.relpath(d, base)
            parts = [pkg] + ([] if rel == "." else rel.split(os.sep))
            for f in files:
                if f.endswith(".py"):
                    name = parts if f == "__init__.py" else parts + [f[:-3]]
                    out[".".join(name)] = os.path.join(d, f)
                elif f.endswith(".pyi") and not os.path.exists(os.path.join(d, f[:-1])):  # a native module's stub
                    out.setdefault(".".join(parts + [f[:-4]]), os.path.join(d, f))
    return out


def _imports(name: str, path: str, known: Set[str]) -> Set[str]:
    """Every module of the distribution that ``name`` imports, anywhere in its source."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out: Set[str] = set()

    def add(mod: str) -> None:
        while mod and mod not in known:  # `import a.b.c` depends on the deepest module that exists
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import submodule` depends on the submodule, not pkg
                if f"{mod}.{a.name}" in known:
                    add(f"{mod}.{a.name}")
                else:
                    add(mod)
    return out


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    comps: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_no_import_circle_inside_a_package():
    graph = _graph()
    # edges between packages are one-way by design (adapters -> engine); a circle is one inside a package
    inside = {v: {w for w in ws if w.split(".")[0] == v.split(".")[0]} for v, ws in graph.items()}
    assert _cycles(inside) == []


def test_the_checker_sees_a_circle():
    assert _cycles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}) == [["p.a", "p.b", "p.c"]]


def test_adapters_import_only_public_engine_names():
    bad = []
    for name, path in _modules().items():
        if name.split(".")[0] not in ADAPTERS:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            mods: List[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "layerckpt":
                mods = [f"layerckpt.{node.attr}"]
            for m in mods:
                parts = m.split(".")
                if parts[0] == "layerckpt" and any(p.startswith("_") for p in parts[1:]):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {m}")
    assert bad == []


@pytest.mark.parametrize("rel", SHORT)
def test_no_long_functions(rel):
    path = os.path.join(ROOT, rel)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert long == []
