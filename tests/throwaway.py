"""A PostgreSQL 15 of a test's own, to stop as a crash would and start again.

The suite's shared servers are never restarted; a test that needs its database to go away (an
outage, a restart under a connection) makes one of these on a port of the system's choosing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgonce.store.migrate import migrate
from tests.topology.cluster import _account, _free_port

BIN = Path("/usr/lib/postgresql/15/bin")

#: For a module whose tests all need one.
needs_pg_ctl = pytest.mark.skipif(
    not (BIN / "pg_ctl").exists(), reason="needs PostgreSQL 15's initdb and pg_ctl"
)


class Server:
    """One such server (as an unprivileged account when the tests run as root, which PostgreSQL
    refuses)."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.port = port
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        self.account = _account()
        if self.account is not None:
            os.chown(folder, self.account.pw_uid, self.account.pw_gid)

    def run(self, *command: str) -> None:
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            user=self.account.pw_uid if self.account else None,
            group=self.account.pw_gid if self.account else None,
            cwd=self.folder,
        )

    def _ctl(self, *args: str) -> None:
        log = str(self.folder / "log")
        self.run(str(BIN / "pg_ctl"), "-D", str(self.data), "-w", "-l", log, *args)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "start")

    def crash(self) -> None:
        self._ctl("-m", "immediate", "stop")


@contextlib.contextmanager
def throwaway_server(prefix: str, *, migrated: bool = True) -> Iterator[Server]:
    """A started server in a folder of its own, pgonce's schema migrated unless told otherwise;
    stopped and removed after."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    running = Server(folder, _free_port())
    try:
        running.run(str(BIN / "initdb"), "-D", str(running.data), "-U", "postgres", "-A", "trust")
        running.start()
        if migrated:
            with psycopg.connect(running.dsn, autocommit=True) as conn:
                migrate(conn, "pgonce")
        yield running
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            running.crash()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def decoding_server(prefix: str) -> Iterator[Server]:
    """A throwaway server with logical decoding and prepared transactions (for a replication
    slot, a prepared transaction), which the shared servers may lack; skips without pg_ctl."""
    if not (BIN / "pg_ctl").exists():
        pytest.skip("needs PostgreSQL 15's initdb and pg_ctl")
    with throwaway_server(prefix) as running:
        with psycopg.connect(running.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET wal_level = 'logical'")
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 2")
        running.crash()
        running.start()
        yield running
