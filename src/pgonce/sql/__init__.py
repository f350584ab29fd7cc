"""Every statement pgonce runs, loaded by name from the ``.sql`` files beside this module.

- ``schema.sql`` is the full current schema, for reading and for the migration test.
- ``migrations/NNNN_name.sql`` build it step by step; ``pgonce migrate`` applies them. DDL files use
  unqualified names: the migration runner sets ``search_path`` to pgonce's schema for them.
- ``queries/*.sql`` hold named runtime statements (``-- name: claim``). They run on the caller's
  connection, whose ``search_path`` is the application's, so they are qualified with ``{schema}``,
  composed here with :class:`psycopg.sql.Identifier` and never from input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

from pgonce.core.frozen import refuse_changes

_NAME_LINE = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@refuse_changes
@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    text: str


def _read(*parts: str) -> str:
    return resources.files(__package__).joinpath(*parts).read_text(encoding="utf-8")


@cache
def migrations() -> tuple[Migration, ...]:
    """All migrations, in version order (each version once)."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a version: {versions}")
    return tuple(found)


@cache
def schema_sql() -> str:
    """The full current schema (unqualified names, like the migrations)."""
    return _read("schema.sql")


def parse_named(text: str) -> dict[str, str]:
    """Split a queries file into ``{name: statement}`` at its ``-- name:`` lines."""
    parts = _NAME_LINE.split(text)
    statements: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in statements:
            raise RuntimeError(f"query {name!r} is defined twice")
        statements[name] = body.strip()
    return statements


@cache
def _raw_queries(group: str) -> dict[str, str]:
    return parse_named(_read("queries", f"{group}.sql"))


@cache
def query(group: str, name: str, schema: str) -> bytes:
    """The statement ``name`` of ``queries/<group>.sql``, qualified with ``schema``, as bytes.

    Rendered once per schema and cached: the hot path pays no composition cost.
    """
    try:
        text = _raw_queries(group)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in queries/{group}.sql") from None
    composed = sql.SQL(text).format(schema=sql.Identifier(schema))
    return composed.as_string(None).encode()


class Queries:
    """The named statements of one queries file, for one schema: ``Queries("keys", s).claim``."""

    def __init__(self, group: str, schema: str) -> None:
        self._group = group
        self._schema = schema

    def __getattr__(self, name: str) -> bytes:
        if name.startswith("_"):
            raise AttributeError(name)
        return query(self._group, name, self._schema)


_NAMED_PLACEHOLDER = re.compile(rb"%\((\w+)\)s")


@cache
def positional(statement: bytes, names: tuple[str, ...]) -> bytes:
    """``statement`` with its ``%(name)s`` placeholders as ``$n``, numbered by ``names``.

    One text serves both paths: psycopg binds the named form, libpq (the store's batches) the
    positional one. Every placeholder must be in ``names``.
    """

    def number(match: re.Match[bytes]) -> bytes:
        name = match[1].decode()
        if name not in names:
            raise KeyError(f"placeholder {name!r} is not among {names}")
        return b"$%d" % (names.index(name) + 1)

    return _NAMED_PLACEHOLDER.sub(number, statement)
