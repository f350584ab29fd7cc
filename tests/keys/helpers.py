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
