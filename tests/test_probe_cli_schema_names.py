"""Schema names that are PostgreSQL's own: refused before anything connects, never migrated into.

``information_schema`` took pgonce's tables without a word, and pg_dump leaves that schema out of
every backup; a ``pg_`` name reached the server and failed in the middle of ``pgonce migrate``.
"""

from __future__ import annotations

import psycopg
import pytest

from pgonce.config import Settings, validate_schema
from pgonce.errors import ConfigError
from tests.test_cli import pgonce

SYSTEM_NAMES = ["information_schema", "pg_catalog", "pg_temp", "pg_pgonce"]


@pytest.mark.parametrize("name", SYSTEM_NAMES)
def test_a_system_schema_name_is_refused_by_the_settings(name: str) -> None:
    with pytest.raises(ConfigError, match="is PostgreSQL's own"):
        validate_schema(name)
    with pytest.raises(ConfigError, match="is PostgreSQL's own"):
        Settings(schema=name)


@pytest.mark.parametrize("name", ["pgonce", "public", "pgx", "my_pg_tables", "_pg"])
def test_names_that_only_look_alike_are_allowed(name: str) -> None:
    assert validate_schema(name) == name


@pytest.mark.parametrize("name", SYSTEM_NAMES)
def test_migrate_refuses_a_system_schema_and_creates_nothing(direct_dsn: str, name: str) -> None:
    result = pgonce("migrate", "--dsn", direct_dsn, "--schema", name)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"pgonce: error: schema name {name!r} is PostgreSQL's own"), line
    with psycopg.connect(direct_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'information_schema'::regnamespace "
            "AND relname = 'schema_migrations'"
        ).fetchone()
    assert row == (0,)


def test_a_system_schema_from_the_environment_is_refused_too(direct_dsn: str) -> None:
    result = pgonce(
        "migrate", "--status", env={"PGONCE_DSN": direct_dsn, "PGONCE_SCHEMA": "information_schema"}
    )
    assert result.returncode == 1, result.stderr
    assert "is PostgreSQL's own" in result.stderr
    assert "Traceback" not in result.stderr
