"""The code standards CI holds us to: mypy --strict and ruff, on the package as shipped, its tests,
benchmarks and examples."""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


MYPY = [sys.executable, "-m", "mypy", "--strict"]
# Each example folder is a suite of its own with its own conftest.py: one mypy run each, as one
# run would see several modules named conftest. Found, not listed: a new folder is checked too.
EXAMPLES = ROOT / "examples"
EXAMPLE_SUITES = {"examples": sorted(str(p.relative_to(ROOT)) for p in EXAMPLES.glob("*.py"))} | {
    f"examples-{d.name}": [str(d.relative_to(ROOT))] for d in sorted(EXAMPLES.iterdir()) if any(d.glob("*.py"))}
TOOLS = {
    "mypy": [*MYPY, "pytest_smolvm"],
    "mypy-tests": [*MYPY, "tests", "benchmarks"],
    **{f"mypy-{name}": [*MYPY, *paths] for name, paths in EXAMPLE_SUITES.items()},
    "ruff": [sys.executable, "-m", "ruff", "check", "pytest_smolvm", "tests", "examples", "benchmarks"],
}


@pytest.mark.parametrize("tool", TOOLS.values(), ids=TOOLS.keys())
def test_clean(tool: list[str]) -> None:
    if find_spec(tool[2]) is None:  # a missing checker is a failure, not a pass
        pytest.fail(f"{tool[2]} is not installed (pip install '.[test]')")
    result = subprocess.run(tool, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ the package's shape

PACKAGE = ROOT / "pytest_smolvm"
MAX_MODULE_LINES = 400
# Rooms from the top down (docs/architecture.md): a module imports only its own room or rooms
# below it. The pytest face (plugin), the command and the Inspect provider share the top; evals
# (episodes, result lines, the viewer) is below them: the plugin hands it what it needs (evals/glue.py).
ROOMS = [("plugin", "cli", "integrations"), ("evals",), ("session",), ("handle",), ("backends",), ("baselines",),
         ("untrusted",), ("host",), ("errors", "limits", "inert")]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, counting every import statement: lazy ones
    inside functions and ``TYPE_CHECKING`` ones too (a cycle hidden in a function is a cycle)."""
    import ast

    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                stem = ".".join(p for p in (base, node.module or "") if p)
                submodules = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in modules]
                targets = submodules if len(submodules) == len(node.names) else [stem, *submodules]
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_lazy_ones_included() -> None:
    assert cycles(import_graph()) == []


def test_no_module_imports_the_top_level_package() -> None:
    """The package's __init__ lazily imports the public handle; a module that imports the package
    itself (``import pytest_smolvm``) would close a loop through it."""
    graph = import_graph()
    offenders = sorted(name for name, deps in graph.items() if "pytest_smolvm" in deps and name != "pytest_smolvm")
    assert offenders == []


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: size for name, size in sizes.items() if size > MAX_MODULE_LINES} == {}


def test_the_zygote_loads_every_module_of_its_helper_after_those_it_imports() -> None:
    """The helper runs from code the host sends (helper/__init__.py): a module missing from
    ``MODULES``, or loaded before one it imports, kills it at its start, every guest with it."""
    from pytest_smolvm.backends.namespace.helper import MODULES

    package = "pytest_smolvm.backends.namespace.helper"
    folder = ROOT / "pytest_smolvm" / "backends" / "namespace" / "helper"
    assert sorted(MODULES) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    graph = import_graph()
    late = [f"{name} imports {dep}" for i, name in enumerate(MODULES) for dep in graph[f"{package}.{name}"]
            if dep.startswith(f"{package}.") and dep.rsplit(".", 1)[1] not in MODULES[:i]]
    assert late == []


def test_rooms_import_only_downwards() -> None:
    rank = {room: level for level, rooms in enumerate(ROOMS) for room in rooms}

    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in rank else None

    upward = sorted(f"{name} -> {dep}" for name, deps in import_graph().items() for dep in deps
                    if room(name) and room(dep) and rank[room(dep)] < rank[room(name)])  # type: ignore[index]
    assert upward == []


def test_the_public_api_is_what_the_reference_says() -> None:
    """Every name in ``__all__`` imports, and the reference's import line names exactly them."""
    import re

    import pytest_smolvm

    for name in pytest_smolvm.__all__:
        assert getattr(pytest_smolvm, name) is not None, name
    reference = (ROOT / "docs" / "reference.md").read_text()
    block = re.search(r"from pytest_smolvm import \(([^)]*)\)", reference)
    assert block is not None
    documented = {name.strip() for name in block.group(1).split(",")}
    assert documented == set(pytest_smolvm.__all__)
