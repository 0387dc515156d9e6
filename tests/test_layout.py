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
