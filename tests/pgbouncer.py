"""A PgBouncer of the suite's own, in transaction pooling mode, in front of the test server.

Debian's pgbouncer (1.18 on this project's CI) is started once per test process on a free port
by the project's one launcher (:class:`faults.cluster.PgBouncer`), with a wildcard database entry,
so that every per-test database of the test server is reachable through it under the same name.
Without the binary the tests that need it skip with the reason, except under
``PGONCE_REQUIRE_SERVICES=1`` (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from faults.cluster import PgBouncer, pgbouncer


def require_pgbouncer() -> str:
    """The pgbouncer binary; skip (fail under PGONCE_REQUIRE_SERVICES=1) when it is missing."""
    binary = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if binary:
        return binary
    reason = "pgbouncer is not installed (apt-get install pgbouncer) to run the pooled variants"
    if os.environ.get("PGONCE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (PGONCE_REQUIRE_SERVICES=1 requires it)")
    pytest.skip(reason)


@contextlib.contextmanager
def running_pgbouncer(
    server_dsn: str, *, pool_size: int = 10, pool_mode: str = "transaction"
) -> Iterator[str]:
    """Start PgBouncer in front of ``server_dsn``; yield the server DSN rewritten to go through
    it (same user and database). Stopped, and its folder removed, on exit.

    ``pool_size`` server sessions per database: the test server's connections are shared by
    parallel test processes. Logins through it give up after 10 s (psycopg's own default is
    130 s), so that a PgBouncer that stopped answering fails a test quickly.
    """
    require_pgbouncer()
    server = conninfo_to_dict(server_dsn)
    host = str(server.get("host") or "127.0.0.1")
    port = int(server.get("port") or 5432)
    with pgbouncer(host=host, port=port, pool_size=pool_size, pool_mode=pool_mode) as bouncer:
        yield make_conninfo(
            server_dsn, host="127.0.0.1", port=str(bouncer.port), connect_timeout="10"
        )


@contextlib.contextmanager
def started_pgbouncer(
    server_dsn: str, *, pool_size: int = 10, pool_mode: str = "transaction"
) -> Iterator[PgBouncer]:
    """Like :func:`running_pgbouncer`, but yield the running PgBouncer itself: for tests that
    stop and start it again, or send its admin console ``PAUSE``, ``RECONNECT`` or ``KILL``
    (:func:`admin`)."""
    require_pgbouncer()
    server = conninfo_to_dict(server_dsn)
    host = str(server.get("host") or "127.0.0.1")
    port = int(server.get("port") or 5432)
    folder = Path(tempfile.mkdtemp(prefix="pgonce-pgbouncer-"))
    bouncer = PgBouncer(folder, host=host, port=port, pool_size=pool_size, pool_mode=pool_mode)
    try:
        # The admin console's PAUSE, RECONNECT and KILL need an admin user ([pgbouncer] is the
        # file's last section).
        with bouncer.config.open("a") as config:
            config.write("admin_users = postgres\n")
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
        shutil.rmtree(folder, ignore_errors=True)


def through(bouncer: PgBouncer, direct_dsn: str) -> str:
    """``direct_dsn``'s database through ``bouncer``, with logins given up after 10 s."""
    return make_conninfo(direct_dsn, host="127.0.0.1", port=str(bouncer.port), connect_timeout="10")


def admin(bouncer: PgBouncer, command: str) -> None:
    """Run ``command`` (``PAUSE db``, ``RESUME db``, ``RECONNECT db``, ``KILL db``) on
    ``bouncer``'s admin console (any user may, under the suite's ``auth_type = any``)."""
    with psycopg.connect(bouncer.dsn("pgbouncer"), autocommit=True, prepare_threshold=None) as c:
        c.execute(command)


def listen_check_started(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> asyncio.Event:
    """An event set when ``module`` (the inbox worker's, the relay's) starts its LISTEN check, the
    self-notification that tells a pooled LISTEN from a direct one."""
    checking = asyncio.Event()
    hears = module.hears

    async def observed(*args: Any, **kwargs: Any) -> bool:
        checking.set()
        result: bool = await hears(*args, **kwargs)
        return result

    monkeypatch.setattr(module, "hears", observed)
    return checking
