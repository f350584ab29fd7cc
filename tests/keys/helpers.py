"""Small helpers for the key store tests: waiting on PostgreSQL's own view of a lock wait."""

from __future__ import annotations

import time
from typing import Any

import psycopg


def wait_until_blocked(observer: psycopg.Connection[Any], pid: int, timeout: float = 10.0) -> None:
    """Return once backend ``pid`` waits on a lock (pg_stat_activity says so); fail after timeout.

    This is a condition, not a sleep: the test proceeds the moment PostgreSQL reports the wait.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = observer.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row and row[0] == "Lock":
            return
        time.sleep(0.005)
    raise AssertionError(f"backend {pid} never waited on a lock")


def sqlalchemy_url(dsn: str, driver: str = "psycopg") -> Any:
    """The SQLAlchemy URL of a psycopg conninfo string (``postgresql+<driver>://...``)."""
    from psycopg.conninfo import conninfo_to_dict
    from sqlalchemy.engine import URL

    params = {name: str(value) for name, value in conninfo_to_dict(dsn).items()}
    port = params.pop("port", None)
    return URL.create(
        f"postgresql+{driver}",
        username=params.pop("user", None),
        password=params.pop("password", None),
        host=params.pop("host", None),
        port=int(port) if port else None,
        database=params.pop("dbname", None),
        query=params,
    )
