"""The layout's promises: `locking/` is framework-free, strategies are one module each."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from django.conf import settings

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

    from inventory.strategies.base import StockStrategy

    assert set(settings.FLASHSALE_STRATEGIES) == {
        "lock",
        "segmented",
        "lua",
        "optimistic",
        "unsafe",
    }
    modules = set()
    for name, path in settings.FLASHSALE_STRATEGIES.items():
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
    return {
        _module_name(path): path
        for layer in LAYERS
        for path in (ROOT / layer).rglob("*.py")
        if "migrations" not in path.parts
    }


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run, function-local ones included; `if TYPE_CHECKING:` blocks
    (annotations only) never run."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _project_modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                resolved = known(target)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_module_imports_itself_back_through_others():
    graph = _import_graph()
    assert len(graph) > 40 and "inventory.strategies.lua" in graph
    assert "inventory.models" in graph["inventory.services"]  # the graph sees imports at all
    assert _cycles(graph) == []


def test_a_cycle_is_found_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
