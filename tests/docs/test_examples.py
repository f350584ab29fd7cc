"""Every ```python block of the documentation and the README runs, against a real PostgreSQL.

Blocks are found by ``pytest-examples`` in ``docs/**/*.md`` and ``README.md`` at collection time,
so a page someone adds is tested without touching this file. Each block runs on its own, in a
database of its own (migrated), which it finds where a user's code would: ``PGONCE_DSN``.

A fence may say what the block needs: ```{.python data-requires="redis"}`` (or ``rabbitmq``,
``nats``) skips it unless that broker answers (and fails under ``PGONCE_REQUIRE_SERVICES=1``, as
in CI). A block that cannot run on its own is marked ```python title="..."`` and is only checked
for syntax. A block that includes code from the repository (``--8<-- "examples/...:section"``)
shows files the suite runs elsewhere: the included section must exist and parse.
"""

from __future__ import annotations

import ast
import sys
import textwrap
import types
from pathlib import Path

import pytest
from pytest_examples import CodeExample, find_examples

from tests.outbox.conftest import require_service

ROOT = Path(__file__).resolve().parent.parent.parent
SERVICES = {"rabbitmq": 5672, "nats": 4222, "redis": 6379}


def examples() -> list[CodeExample]:
    # Sorted: parallel workers must collect the same tests in the same order.
    found = find_examples(ROOT / "docs", ROOT / "README.md")
    return sorted(found, key=lambda e: (e.path.as_posix(), e.start_line))


def _id(example: CodeExample) -> str:
    return f"{example.path.relative_to(ROOT)}:{example.start_line}"


@pytest.fixture
def docs_env(dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PGONCE_DSN", dsn)
    return tmp_path


@pytest.mark.parametrize("example", examples(), ids=_id)
def test_example_runs(example: CodeExample, docs_env: Path) -> None:
    settings = example.prefix_settings()
    included = _included(example.source)
    if included is not None:
        ast.parse(included)
        return
    if "title" in settings:
        ast.parse(example.source)  # shown, not run: it must still be Python
        return
    for service in filter(None, settings.get("data-requires", "").split(",")):
        require_service(service, "127.0.0.1", SERVICES[service])
    # Run as a module of its own, its lines numbered as in the page, so that a traceback points
    # into the Markdown file. It stands in sys.modules while it runs: libraries that resolve a
    # class's annotations through its module (SQLAlchemy's Mapped[...]) find its names there.
    code = compile("\n" * example.start_line + example.source, str(example.path), "exec")
    module = types.ModuleType("__docs_example__")
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _included(source: str) -> str | None:
    """The code a block made only of ``--8<-- "path[:section]"`` lines includes; None for a
    block of its own. Only tested code may be included: files under ``examples/``."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    if not lines or not all(line.startswith("--8<--") for line in lines):
        return None
    parts = []
    for line in lines:
        target = line.removeprefix("--8<--").strip().strip('"')
        path, _, section = target.partition(":")
        assert path.startswith("examples/"), f"{path}: only tested code (examples/) is included"
        text = (ROOT / path).read_text()
        if section:
            start, end = f"# --8<-- [start:{section}]", f"# --8<-- [end:{section}]"
            assert start in text, f"{path} has no section {section!r}"
            assert end in text, f"{path} does not end its section {section!r}"
            text = text.split(start, 1)[1].split(end, 1)[0]
        parts.append(textwrap.dedent(text))
    return "\n".join(parts)


def test_examples_are_found() -> None:
    """The finder sees the pages: an empty collection would pass silently."""
    found = {e.path.relative_to(ROOT).as_posix() for e in examples()}
    assert "docs/getting-started.md" in found
    assert "README.md" in found
