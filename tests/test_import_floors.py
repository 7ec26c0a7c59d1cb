"""The import floors point one way, and no module imports itself back.

    flexmoba  <-  lit.training  <-  lit.experiments  <-  lit.cli          benchmarks -> flexmoba

A module imports from its own floor or below: ``flexmoba`` imports no ``lit``, ``lit.training`` no
``lit.experiments`` or ``lit.cli``, ``lit.experiments`` no ``lit.cli``; ``benchmarks`` import flexmoba,
torch and the standard library, never ``lit`` (and neither ``flexmoba`` nor ``lit`` imports them).

Every ``.py`` under flexmoba/, lit/ and benchmarks/ is read with :mod:`ast`; nothing is imported. Every
import counts wherever it stands: at the top, inside a function (a function-level import is an edge that
holds as soon as the function runs), under ``try``, or in an ``if TYPE_CHECKING:`` block. Relative imports
are resolved against the importing module's package. An import is an edge to a module of these packages:

- ``import a.b.c``: to ``a.b.c`` (or to its longest prefix that is a module of ours);
- ``from a.b import name``: to ``a.b.name`` when that is a submodule, else to ``a.b`` itself, a package's
  ``__init__`` (``from flexmoba import MobaSpec`` is an edge to ``flexmoba/__init__.py``, which is fine
  unless that ``__init__`` is inside a cycle).

The parent packages Python initialises on the way to a submodule are not edges: they are being imported
already when one of their submodules imports a sibling, so they cannot close a cycle by themselves.

``if TYPE_CHECKING:`` imports never run, so the cycle check of ``lit`` leaves them out (annotations may
refer both ways); inside ``flexmoba`` they count too, so the library's types live below the modules that
use them (the backend protocol's types in ``flexmoba/backends/protocol.py``, not in a kernel). The floor
check counts them everywhere: a floor that names an upper one, even for a type, points up.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flexmoba", "lit", "benchmarks")

# floor -> the packages it must not import (a module of a floor is its name or below it)
FLOORS = {
    "flexmoba": ("lit", "benchmarks"),
    "lit.training": ("lit.experiments", "lit.cli", "benchmarks"),
    "lit.experiments": ("lit.cli", "benchmarks"),
    "lit.cli": ("benchmarks",),
    "benchmarks": ("lit",),
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # the importing file, relative to the root read
    line: int
    type_checking: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.AST):
    """``(node, under TYPE_CHECKING)`` for every Import and ImportFrom of ``tree``, at any depth."""
    stack = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack += [(child, True) for child in node.body]
            stack += [(child, typing_only) for child in node.orelse]
            continue
        stack += [(child, typing_only) for child in ast.iter_child_nodes(node)]


def ours(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules``; None for anything else (torch, os, ...)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def base_of(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The module a ``from X import ...`` reads from, relative imports resolved."""
    if not node.level:
        return node.module
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def edges_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    shown = path.relative_to(root).as_posix()
    found = []
    for node, typing_only in imports_of(tree):
        if isinstance(node, ast.Import):
            targets = [ours(alias.name, modules) for alias in node.names]
        else:
            base = base_of(node, module, path)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else ours(base, modules)
                       for alias in node.names]
        found += [Edge(module, target, shown, node.lineno, typing_only)
                  for target in dict.fromkeys(targets) if target is not None and target != module]
    return found


def import_graph(root: Path = REPO, packages=PACKAGES) -> list[Edge]:
    modules = modules_under(root, packages)
    return [edge for module, path in modules.items() for edge in edges_of(module, path, modules, root)]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_of(module: str) -> str | None:
    """The floor ``module`` stands on: the longest one it is within."""
    return max((floor for floor in FLOORS if within(module, floor)), key=len, default=None)


def strongly_connected(nodes: list[str], successors: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(successors.get(start, ())))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return components


def one_cycle(component: list[str], edges: list[Edge]) -> list[Edge]:
    """The shortest cycle through the component's first module, as the imports that make it."""
    members = set(component)
    out: dict[str, list[Edge]] = {}
    for edge in edges:
        if edge.source in members and edge.target in members:
            out.setdefault(edge.source, []).append(edge)
    start = component[0]
    came_by: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in sorted(out.get(node, []), key=lambda e: (e.target, e.line)):
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if edge.target not in came_by:
                came_by[edge.target] = edge
                queue.append(edge.target)
    raise AssertionError(f"no cycle through {start} in {component}")


def cycles(edges: list[Edge], type_checking: bool = False) -> list[tuple[list[str], list[Edge]]]:
    """Each import cycle among runtime imports (and ``TYPE_CHECKING`` ones with ``type_checking``): its modules
    and one cycle through them."""
    runtime = [edge for edge in edges if type_checking or not edge.type_checking]
    successors: dict[str, list[str]] = {}
    for edge in runtime:
        successors.setdefault(edge.source, []).append(edge.target)
    nodes = sorted({edge.source for edge in runtime} | {edge.target for edge in runtime})
    return [(component, one_cycle(component, runtime)) for component in strongly_connected(nodes, successors)
            if len(component) > 1]


def cycle_report(found: list[tuple[list[str], list[Edge]]]) -> str:
    return "\n".join(f"import cycle among {', '.join(component)}:\n"
                     + "\n".join(f"    {e.source} imports {e.target} ({e.where()})" for e in path)
                     for component, path in found)


def upward_imports(edges: list[Edge], floor: str) -> list[Edge]:
    """The imports of modules on ``floor`` (its own, not a higher floor within it) that reach what it must not."""
    return [edge for edge in edges if floor_of(edge.source) == floor
            and any(within(edge.target, banned) for banned in FLOORS[floor])]


# -- the repository ----------------------------------------------------------------------------------------

EDGES = import_graph()


@pytest.mark.parametrize("package, type_checking", [("flexmoba", True), ("lit", False)])
def test_no_import_cycle(package, type_checking):
    inside = [edge for edge in EDGES if within(edge.source, package) and within(edge.target, package)]
    found = [(component, path) for component, path in cycles(inside, type_checking)]
    assert not found, cycle_report(found)


@pytest.mark.parametrize("floor", FLOORS)
def test_no_floor_imports_upward(floor):
    upward = upward_imports(EDGES, floor)
    allowed = ", ".join(f for f in FLOORS if not any(within(f, banned) for banned in FLOORS[floor]))
    assert not upward, f"{floor} may import only {allowed} (and third-party packages):\n" + "\n".join(
        f"    {e.where()}: {e.source} imports {e.target}" + (" (under TYPE_CHECKING)" if e.type_checking else "")
        for e in upward)


def test_every_floor_has_modules_and_imports():
    """The reader sees the repository: every floor holds modules that import something of ours."""
    sources = {floor_of(edge.source) for edge in EDGES}
    assert set(FLOORS) <= sources, set(FLOORS) - sources


# -- the reader itself, on a made-up tree ------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    write_tree(tmp_path, {
        "flexmoba/__init__.py": "from flexmoba.spec import Spec\n",
        "flexmoba/spec.py": "class Spec:\n    def check(self):\n        from flexmoba import gate\n",
        "flexmoba/gate/__init__.py": "from .scores import score\n",
        "flexmoba/gate/scores.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from lit.cli.main import main\nimport flexmoba.spec as spec\n"
                                    "from .. import spec as again\n"),
        "lit/__init__.py": "",
        "lit/training/__init__.py": "",
        "lit/training/run.py": "def go():\n    try:\n        import lit.experiments.x\n    except ImportError:\n"
                               "        pass\n",
        "lit/experiments/__init__.py": "",
        "lit/experiments/x.py": "from lit.training import run\nfrom flexmoba import Spec\n",
        "lit/cli/__init__.py": "",
        "lit/cli/main.py": "",
        "benchmarks/__init__.py": "",
        "benchmarks/b.py": "import torch\nfrom lit.training.run import go\n",
    })
    edges = import_graph(tmp_path)
    seen = {(e.source, e.target, e.type_checking) for e in edges}
    assert seen == {
        ("flexmoba", "flexmoba.spec", False),
        ("flexmoba.spec", "flexmoba.gate", False),  # function-level, a submodule named in `from flexmoba import`
        ("flexmoba.gate", "flexmoba.gate.scores", False),  # relative
        ("flexmoba.gate.scores", "lit.cli.main", True),
        ("flexmoba.gate.scores", "flexmoba.spec", False),  # `import a.b as c` and `from .. import b`, once
        ("lit.training.run", "lit.experiments.x", False),  # inside try, inside a function
        ("lit.experiments.x", "lit.training.run", False),
        ("lit.experiments.x", "flexmoba", False),  # a name re-exported by the package's __init__
        ("benchmarks.b", "lit.training.run", False),
    }
    found = cycles(edges)
    assert [component for component, _ in found] == [
        ["flexmoba.gate", "flexmoba.gate.scores", "flexmoba.spec"], ["lit.experiments.x", "lit.training.run"]]
    assert "flexmoba.spec imports flexmoba.gate (flexmoba/spec.py:3)" in cycle_report(found[:1])
    assert [(e.source, e.target) for e in upward_imports(edges, "flexmoba")] == [("flexmoba.gate.scores",
                                                                                  "lit.cli.main")]
    assert [(e.source, e.target) for e in upward_imports(edges, "lit.training")] == [("lit.training.run",
                                                                                      "lit.experiments.x")]
    assert [(e.source, e.target) for e in upward_imports(edges, "benchmarks")] == [("benchmarks.b",
                                                                                    "lit.training.run")]
    assert upward_imports(edges, "lit.experiments") == []


def test_type_checking_imports_close_no_cycle(tmp_path):
    write_tree(tmp_path, {
        "flexmoba/__init__.py": "",
        "flexmoba/a.py": "import flexmoba.b\n",
        "flexmoba/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from flexmoba.a import A\nelse:\n    A = None\n",
    })
    edges = import_graph(tmp_path, ("flexmoba",))
    assert {(e.source, e.target, e.type_checking) for e in edges} == {
        ("flexmoba.a", "flexmoba.b", False), ("flexmoba.b", "flexmoba.a", True)}
    assert cycles(edges) == []
    assert [component for component, _ in cycles(edges, type_checking=True)] == [["flexmoba.a", "flexmoba.b"]]
