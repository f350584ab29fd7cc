"""``pgonce.phases`` exports the completer loop ``pgonce serve`` runs (``complete_every()``), and
every name the documentation gives under ``pgonce.phases`` is in its ``__all__``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pgonce.phases

DOCS = Path(__file__).parents[2] / "docs"


def test_complete_every_is_exported() -> None:
    assert "complete_every" in pgonce.phases.__all__
    assert inspect.iscoroutinefunction(pgonce.phases.complete_every)


def test_every_name_the_docs_give_under_pgonce_phases_is_exported() -> None:
    named: set[str] = set()
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        named.update(re.findall(r"pgonce\.phases\.(\w+)", text))
        for names in re.findall(r"from pgonce\.phases import ([\w, ]+)", text):
            named.update(name.strip() for name in names.split(","))
    assert named
    assert named <= set(pgonce.phases.__all__)


def test_the_python_reference_lists_complete_every() -> None:
    assert "::: pgonce.phases.complete_every" in (DOCS / "reference" / "python-api.md").read_text()
