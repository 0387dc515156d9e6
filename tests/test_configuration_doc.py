"""docs/configuration.md's table lists exactly the environment variables shop/settings.py reads,
and settings.py names at most 20 FLASHSALE_* (what an operator sets; tuning constants live in
their modules, the tests' and the lab's seams in shop.lab_settings)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "shop" / "settings.py"
DOC = ROOT / "docs" / "configuration.md"
MOST_FLASHSALE_SETTINGS = 20


def _reader(call: ast.Call) -> bool:
    """Whether `call` reads an environment variable: django-environ's `env(...)` and
    `env.<type>(...)`, `bounded(...)`, `os.getenv(...)`, `os.environ.get(...)`."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in ("env", "bounded", "getenv")
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id == "env" or (func.value.id, func.attr) == ("os", "getenv")
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "get"
        and ast.unparse(func.value) == "os.environ"
    )


def variables_read(source: str) -> set[str]:
    """The environment variables a settings module reads, each by a literal name."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and _reader(node) and node.args:
            key = node.args[0]
        else:
            continue
        assert isinstance(key, ast.Constant) and isinstance(key.value, str), (
            f"settings.py line {node.lineno} reads a variable by a computed name: "
            "name it literally, so that the documentation can be held to it"
        )
        names.add(key.value)
    return names


def variables_documented(markdown: str) -> set[str]:
    """The variables named (in backticks) in the first column of the table's rows."""
    names = set()
    for line in markdown.splitlines():
        if line.startswith("|"):
            first_column = line.split("|")[1]
            names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", first_column))
    return names


def test_the_configuration_doc_lists_exactly_what_settings_reads():
    read = variables_read(SETTINGS.read_text())
    documented = variables_documented(DOC.read_text())
    assert read - documented == set(), "read by shop/settings.py, missing from the doc"
    assert documented - read == set(), "in docs/configuration.md, read by no setting"


def test_settings_names_at_most_twenty_flashsale_settings():
    named = set(re.findall(r"\bFLASHSALE_[A-Z0-9_]+", SETTINGS.read_text()))
    assert len(named) <= MOST_FLASHSALE_SETTINGS, sorted(named)


def test_the_reader_finds_every_form_of_read():
    source = (
        "import os\n"
        "A = env.str('A', default='')\n"
        "B = env('B')\n"
        "C = bounded('C', 1, 0, 2)\n"
        "D = os.environ.get('D')\n"
        "E = os.environ['E']\n"
        "F = os.getenv('F')\n"
        "G = other('G')\n"
    )
    assert variables_read(source) == {"A", "B", "C", "D", "E", "F"}
