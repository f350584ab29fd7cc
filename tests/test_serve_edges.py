"""`pgonce serve` at the edges of its start: an address it cannot listen on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: TEST-NET-1 (RFC 5737): an IP address no host of a test machine has.
NOT_OURS = "192.0.2.1"


def pgonce(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgonce", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def fresh_database(direct_dsn: str) -> str:
    """An empty database beside the test's own: whether serve migrated shows in it."""
    name = psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"]
    empty = f"{name}_empty"
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(empty)))
    return psycopg.conninfo.make_conninfo(direct_dsn, dbname=empty)


def has_pgonce_schema(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'pgonce'").fetchone()
    return row is not None and row[0] == 1


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ("999.1.1.1", "'999.1.1.1' is neither an IP address nor a host name this host resolves"),
        (NOT_OURS, f"{NOT_OURS} is not an address of this host"),
    ],
    ids=["not an address", "not this host's"],
)
def test_a_host_option_that_cannot_be_bound_is_a_usage_error_before_anything_starts(
    direct_dsn: str, host: str, says: str
) -> None:
    dsn = fresh_database(direct_dsn)
    try:
        result = pgonce("serve", "--host", host, "--port", "0", "--dsn", dsn)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("usage: pgonce serve")
        (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
        assert line.startswith(f"pgonce serve: error: --host {host}: {says}"), line
        assert "--host or [server] host" in line
        assert "--port" not in line  # the old hint blamed another process holding the port
        assert result.stdout == ""
        assert not has_pgonce_schema(dsn)  # refused before the start migrated anything
    finally:
        drop(direct_dsn, dsn)


def test_a_configured_host_that_cannot_be_bound_is_one_line_naming_the_setting(
    direct_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text(f'[server]\nhost = "{NOT_OURS}"\nport = 0\n')
    result = pgonce("serve", "--config", str(config), "--dsn", direct_dsn)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert line.startswith(
        f"pgonce: error: [server] host '{NOT_OURS}': {NOT_OURS} is not an address of this host"
    ), line
    assert "another process" not in line


def drop(direct_dsn: str, dsn: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(str(name))
            )
        )
