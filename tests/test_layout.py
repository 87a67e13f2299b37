"""The test suite's layout: modules share code through tests/helpers.py and tests/conftest.py, never by importing a test
module (one imported by another runs as a library too: its module fixtures and constants leak into the importer, and
moving or renaming a test breaks files that test something else)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``test_*``) a module's source imports, at any depth (function-local imports too)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from . import test_x`: the imported names are modules
                names += [alias.name for alias in node.names]
            elif node.module:
                names.append(node.module)
    return sorted(n for n in names if n.split(".")[0].startswith("test_"))


def test_the_finder_sees_each_form_of_import_and_only_test_modules():
    source = ("import os, test_b as b\nfrom test_c import x\nfrom helpers import test_like_name\n"
              "def f():\n    from test_d.sub import y\n    import test_a\n")
    assert imported_test_modules(source) == ["test_a", "test_b", "test_c", "test_d.sub"]
    assert imported_test_modules("from . import test_e\nimport helpers\nfrom conftest import REPO\n") == ["test_e"]


def test_no_module_under_tests_imports_a_test_module():
    files = sorted(TESTS.glob("*.py"))
    assert len([f for f in files if f.name.startswith("test_")]) > 10  # the folder the suite runs from
    offenders = {f.name: found for f in files if (found := imported_test_modules(f.read_text()))}
    assert offenders == {}, f"import shared code from tests/helpers.py or tests/conftest.py instead: {offenders}"
