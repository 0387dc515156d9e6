"""The layout's promises: `locking/` is framework-free, strategies are one module each, imports
run down the layers and never in a cycle (every import counts, wherever it is written)."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_locking_never_imports_django():
    for path in (ROOT / "locking").rglob("*.py"):
        assert "django" not in _imported_modules(path), path
    # and it imports in an interpreter where Django is not even set up
    code = "import locking, sys; assert not any(m.startswith('django') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_each_strategy_is_its_own_module_behind_the_base_contract():
    from django.utils.module_loading import import_string

    from inventory.strategies import STRATEGIES
    from inventory.strategies.base import StockStrategy

    assert set(STRATEGIES) == {
        "lock",
        "segmented",
        "lua",
        "optimistic",
        "unsafe",
    }
    modules = set()
    for name, path in STRATEGIES.items():
        strategy = import_string(path)
        assert issubclass(strategy, StockStrategy) and strategy.name == name
        modules.add(strategy.__module__)
    assert len(modules) == 5


# -- the import graph -----------------------------------------------------------------------

#: Lowest first: a package imports only its own layer and the ones below.
LAYERS = ["locking", "inventory", "shop", "loadtest", "pitfalls"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(path): path for layer in LAYERS for path in (ROOT / layer).rglob("*.py")}


def _imports_of(name: str, source: str, modules: Iterable[str], *, package: bool) -> dict[str, int]:
    """The project modules the module `name` imports, each with the line of its first import.

    Every import statement counts, wherever it is: at the top, inside a function or a class,
    under `if TYPE_CHECKING:`. A reader follows each of them, and a cycle through a
    function-local import is a cycle all the same: it only runs later. (What Django imports by
    a dotted path from the settings, `import_string`, is not an import statement.)
    """
    known_modules = set(modules)

    def known(target: str) -> str | None:
        while target and target not in known_modules:
            target = target.rpartition(".")[0]
        return target or None

    anchor_package = name if package else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = anchor_package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known_modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            resolved = known(target)
            if resolved and resolved != name:
                found[resolved] = min(found.get(resolved, node.lineno), node.lineno)
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    """Each project module: the project modules it imports, each with the line that does."""
    modules = _project_modules()
    return {
        name: _imports_of(name, path.read_text(), modules, package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def _cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _a_cycle(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest cycle through the component's first module: [a, b, ..., a]."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for other in sorted(graph[node]):
            if other == start:
                return [*paths[node], start]
            if other in members and other not in paths:
                paths[other] = [*paths[node], other]
                queue.append(other)
    raise AssertionError(f"{component} is no cycle")


def _named(cycle: list[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    """The cycle as a reader follows it, each step with the import that makes it."""
    steps = [
        f"{module} imports {target} (line {graph[module][target]})"
        for module, target in itertools.pairwise(cycle)
    ]
    return " -> ".join(steps)


def _cycles_named(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    return [_named(_a_cycle(component, graph), graph) for component in _cycles(graph)]


def test_no_module_imports_itself_back_through_others():
    graph = _import_graph()
    assert len(graph) > 40 and "inventory.strategies.lua" in graph
    assert "inventory.models" in graph["inventory.services"]  # the graph sees imports at all
    cycles = _cycles_named(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_a_cycle_is_found_and_named_by_its_imports():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles_named(graph) == [
        "a imports b (line 3) -> b imports c (line 5) -> c imports a (line 7)"
    ]


def test_imports_under_type_checking_and_inside_functions_count():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .strategies.base import Allocation\n"
        "def rows_apart():\n"
        "    from .strategies import get_strategy\n"
    )
    modules = ["inventory.keys", "inventory.strategies", "inventory.strategies.base"]
    found = _imports_of("inventory.keys", source, modules, package=False)
    assert found == {"inventory.strategies.base": 3, "inventory.strategies": 5}


def test_imports_run_down_the_layers_only():
    upward = [
        (module, target)
        for module, targets in _import_graph().items()
        for target in targets
        if LAYERS.index(target.split(".")[0]) > LAYERS.index(module.split(".")[0])
    ]
    assert upward == []


def test_the_tasks_published_by_name_are_registered():
    import inventory.tasks  # noqa: F401 - what a worker's autodiscovery imports
    from inventory import publishing
    from shop.celery import app

    registered = set(app.tasks)
    published = {
        publishing.PROCESS_ORDER_TASK,
        publishing.SETTLE_ORDERS_TASK,
        publishing.GIVE_BACK_TASK,
    }
    assert published <= registered
