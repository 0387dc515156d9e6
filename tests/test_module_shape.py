"""Each product module stays one a reader can take in: at most 500 lines, and a module docstring
of at most 15 (purpose, invariants, a link to the docs or the decision record)."""

from __future__ import annotations

import ast

import pytest

from tests.test_layout import ROOT, _project_modules

MAX_LINES = 500
MAX_DOCSTRING_LINES = 15

#: Migrations are generated history, not modules to read: left out.
MODULES = sorted(
    str(path.relative_to(ROOT))
    for path in _project_modules().values()
    if "migrations" not in path.parts
)


def _broken_rules(text: str) -> set[str]:
    broken = set()
    if len(text.splitlines()) > MAX_LINES:
        broken.add("lines")
    docstring = ast.get_docstring(ast.parse(text))
    if docstring and len(docstring.splitlines()) > MAX_DOCSTRING_LINES:
        broken.add("docstring")
    return broken


@pytest.mark.parametrize("module", MODULES)
def test_each_module_keeps_to_its_length_and_a_short_docstring(module):
    assert _broken_rules((ROOT / module).read_text()) == set()


def test_a_long_module_or_docstring_is_caught():
    docstring = '"""' + "\n".join(f"line {n}" for n in range(16)) + '\n"""\n'
    assert _broken_rules(docstring) == {"docstring"}
    assert _broken_rules(docstring.replace("line 15\n", "")) == set()
    assert _broken_rules("x = 1\n" * 501) == {"lines"}
    assert _broken_rules("x = 1\n" * 500) == set()
