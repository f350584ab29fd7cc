"""core/ holds pure decisions: it imports the standard library and pgonce's own core and errors,
never psycopg or a framework (DESIGN: arrows point down only)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import pgonce.core

CORE = Path(pgonce.core.__file__).parent
ALLOWED = ("pgonce.core", "pgonce.errors")


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_the_standard_library_and_itself(path: Path) -> None:
    foreign = {
        name
        for name in imported(path)
        if name.split(".")[0] not in sys.stdlib_module_names
        and not name.startswith(ALLOWED)
        and name != "__future__"
    }
    assert not foreign, f"{path.name} imports {sorted(foreign)}: core/ does no I/O"
