"""`pgonce serve` at the edges of its start: an address it cannot listen on, and a start-up
migration that waits for a lock another session holds."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from pgonce import sql as pgsql
from pgonce.store.migrate import _apply_one
from tests.test_cli import pgonce

ROOT = Path(__file__).resolve().parent.parent

#: TEST-NET-1 (RFC 5737): an IP address no host of a test machine has.
NOT_OURS = "192.0.2.1"


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


#: The runners' lock that each migration takes first (queries/migrate.sql, name: lock).
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('pgonce.migrate'), hashtext('pgonce'))"

#: The real command line, with the bound on the migration lock shortened for the test.
SHORT_BOUND = """
import sys
from datetime import timedelta
import pgonce.cli.serve
pgonce.cli.serve.MIGRATION_LOCK_WAIT = timedelta(seconds=3)
from pgonce.cli import main
sys.exit(main(sys.argv[1:]))
"""


def serve(dsn: str, *, code: str | None = None) -> subprocess.Popen[str]:
    start = ["-c", code] if code else ["-m", "pgonce"]
    return subprocess.Popen(
        [sys.executable, *start, "serve", "--dsn", dsn, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PGONCE__SERVER__LOG_FORMAT": "text"},
    )


def wait_for_lock_wait(dsn: str, locktype: str, process: subprocess.Popen[str]) -> None:
    """Until a backend of the database waits for a lock of ``locktype`` (the start migrating)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                "WHERE NOT l.granted AND l.locktype = %s AND d.datname = current_database()",
                (locktype,),
            ).fetchone()
            if row is not None and row[0] > 0:
                return
            conn.execute("SELECT pg_sleep(0.05)")
    raise AssertionError(f"the start never waited for the lock: {process.poll()=}")


@contextmanager
def lines_of(stream: object) -> Iterator[queue.Queue[str]]:
    """The stream's lines as they come, read by a thread."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield lines


def next_line_with(lines: queue.Queue[str], text: str, seen: list[str]) -> str:
    while True:
        line = lines.get(timeout=60)
        seen.append(line)
        if text in line:
            return line


def database_at_version(direct_dsn: str, version: int) -> str:
    """A database beside the test's own, migrated up to ``version`` only."""
    dsn = fresh_database(direct_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for migration in pgsql.migrations():
            if migration.version <= version:
                _apply_one(conn, "pgonce", migration.text, migration.version, migration.name)
    return dsn


def test_a_start_up_migration_blocked_by_a_table_lock_says_once_who_holds_it(
    direct_dsn: str,
) -> None:
    pending = pgsql.migrations()[-1].version
    # 0019 rebuilds indexes of pgonce.keys: it needs the table's lock.
    dsn = database_at_version(direct_dsn, 18)
    try:
        with psycopg.connect(dsn) as holder:
            holder.execute("LOCK TABLE pgonce.keys IN ACCESS EXCLUSIVE MODE")
            process = serve(dsn)
            try:
                with lines_of(process.stderr) as errors, lines_of(process.stdout) as output:
                    wait_for_lock_wait(dsn, "relation", process)
                    seen: list[str] = []
                    line = next_line_with(errors, "the start-up migration waits for", seen)
                    assert "a lock on pgonce.keys" in line, line
                    assert f"held by the session of pid {holder.info.backend_pid} " in line
                    assert "LOCK TABLE pgonce.keys" in line
                    holder.commit()  # the lock goes: the start goes on
                    next_line_with(output, "serving on", [])
                    next_line_with(errors, f"applied migrations 0019, {pending:04d}", seen)
                    said = [text for text in seen if "the start-up migration waits" in text]
                    assert len(said) == 1, said
            finally:
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=60) == 0
    finally:
        drop(direct_dsn, dsn)


def test_a_start_up_migration_waits_for_another_runners_lock_within_a_bound(
    direct_dsn: str,
) -> None:
    with psycopg.connect(direct_dsn) as holder:
        holder.execute(MIGRATION_LOCK)  # held, as by a `pgonce migrate` in its transaction
        process = serve(direct_dsn, code=SHORT_BOUND)
        try:
            wait_for_lock_wait(direct_dsn, "advisory", process)
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise AssertionError("the start waited for the migration lock, unbounded") from None
        holder_pid = holder.info.backend_pid
    assert process.returncode == 1, err
    assert "Traceback" not in err
    assert "serving on" not in out
    (said,) = [line for line in err.splitlines() if "the start-up migration waits for" in line]
    assert f"the migration lock, held by the session of pid {holder_pid} " in said
    (line,) = [line for line in err.splitlines() if line.startswith("pgonce: error:")]
    assert line.startswith(
        "pgonce: error: waited 3s for the migration lock of schema pgonce, to apply or skip "
        "migration 0001_"
    ), line
    assert "another pgonce migrate, or a pgonce serve starting, holds it" in line
