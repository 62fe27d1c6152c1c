"""The house rules that keep the code changeable, checked on the source itself.

- no import circle among the modules of a package (module-level, function-level and TYPE_CHECKING
  imports all count: a lazy import is still a dependency);
- the engine's stages are folders (``io``, ``format``, ``select``, ``write``, ``tiers``, ``read``), each importing only
  what its docstring's "May import" names, and at most 20 modules stand at the top;
- one module imports the native extension;
- the adapters use only the engine's public names (no ``layerckpt._private`` module);
- the entry modules read as lists of named steps: no function over 60 lines.
"""
from __future__ import annotations

import ast
import os
import re
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
STAGES = ("io", "format", "select", "write", "tiers", "read")  # the engine's private stage folders
MAX_TOP = 20
SHORT = [
    "core/layerckpt/checkpointer.py", "core/layerckpt/restore.py", "core/layerckpt/select/_plan.py",
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
                if parts[0] == "layerckpt" and (any(p.startswith("_") for p in parts[1:])
                                                or (len(parts) > 1 and parts[1] in STAGES)):
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


def _allowed(stage: str) -> Set[str]:
    """What a stage folder's docstring says it may import: the names in double backticks of its "May import:" line,
    up to "Never"/"Neither" (stage folders by name, top modules as ``layerckpt.<name>``)."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGES["layerckpt"], stage, "__init__.py")).read())) or ""
    start = doc.find("May import:")
    assert start >= 0, f"layerckpt/{stage}/__init__.py says nothing of what it may import"
    text = doc[start:]
    for stop in ("Never", "Neither"):
        if stop in text:
            text = text[: text.index(stop)]
    names = set()
    for n in re.findall(r"``([^`]+)``", text):
        n = n.removeprefix("layerckpt.")
        names.add(n if n in STAGES else f"layerckpt.{n}")
    return names


def _stage_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "layerckpt" and parts[1] in STAGES else ""


def _stage_violations(graph: Dict[str, Set[str]], allowed: Dict[str, Set[str]]) -> List[str]:
    """Each import of a stage folder's module that its folder's rule does not allow (its own folder always is)."""
    bad = []
    for mod, deps in sorted(graph.items()):
        stage = _stage_of(mod)
        if not stage:
            continue
        for d in sorted(deps):
            if d.split(".")[0] != "layerckpt":
                continue
            target = _stage_of(d) or d
            if target not in allowed[stage] | {stage}:
                bad.append(f"{mod} -> {d}")
    return bad


def test_each_stage_folder_imports_only_what_its_docstring_allows():
    allowed = {s: _allowed(s) for s in STAGES}
    assert allowed["io"] == {"layerckpt.errors"}
    assert "write" not in allowed["select"] and "read" not in allowed["select"]
    for s in ("io", "format"):
        assert not set(STAGES[2:]) & allowed[s], f"{s} may import a stage"
    assert _stage_violations(_graph(), allowed) == []


def test_the_stage_checker_sees_a_back_arrow():
    graph = {"layerckpt.select._plan": {"layerckpt.write._flush", "layerckpt.format._manifest", "numpy"},
             "layerckpt.format._manifest": {"layerckpt.errors"}}
    allowed = {"select": {"format", "layerckpt.errors"}, "format": {"layerckpt.errors"}}
    assert _stage_violations(graph, allowed) == ["layerckpt.select._plan -> layerckpt.write._flush"]


def test_the_stage_folders_are_layered():
    """io < format < select < write < tiers < read: each may import only folders before it, so no two folders import
    each other."""
    for i, s in enumerate(STAGES):
        assert {a for a in _allowed(s) if a in STAGES} <= set(STAGES[:i]), s


def test_at_most_twenty_modules_stand_at_the_top():
    top = [f for f in os.listdir(PACKAGES["layerckpt"]) if f.endswith(".py")]
    assert len(top) <= MAX_TOP, sorted(top)


def test_one_module_imports_the_native_extension():
    importers = sorted(m for m, deps in _graph().items() if "layerckpt.io._uring" in deps)
    assert importers == ["layerckpt.io._backend"]


def _test_extra() -> Set[str]:
    """The import names of what pyproject.toml's [test] extra installs."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    return {re.split(r"[\[<>=!~ ]", req, maxsplit=1)[0].strip().lower().replace("-", "_") for req in extra}


def test_what_the_test_extra_installs_is_imported_never_skipped():
    """A dependency the [test] extra installs is imported plainly by the tests: its absence is a broken install,
    and importorskip would turn it into skipped files and a green run."""
    extra = _test_extra()
    assert {"moto", "s3fs", "lightning", "transformers"} <= extra, extra
    skips = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for mod in re.findall(r"importorskip\(\s*['\"]([\w.]+)['\"]", line):
                    if mod.split(".")[0].lower() in extra:
                        skips.append(f"tests/{name}:{n}: importorskip({mod!r})")
    assert not skips, "import these plainly (the [test] extra installs them):\n" + "\n".join(skips)


def test_every_package_folder_is_in_the_distribution():
    """A package folder pyproject.toml does not list is missing from every install but an editable one."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, base in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, base)
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert found <= listed, sorted(found - listed)
