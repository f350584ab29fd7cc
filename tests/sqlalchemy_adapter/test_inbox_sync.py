"""process_batch(): inbox handlers that take a sync Session, in the transaction that marks their
events done -- on a real PostgreSQL, and through a process killed mid-handler."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session, sessionmaker

from pgonce.contrib.sqlalchemy import NotPsycopgSession, enqueue, process_batch
from pgonce.core.inbox import Delivery, InboxEvent, Ordering, RetryPolicy, digest
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.store._sync.inbox import InboxStore
from tests.inbox.conftest import SCHEMA
from tests.sqlalchemy_adapter.batch_process import APPLICATION_NAME
from tests.sqlalchemy_adapter.models import Order

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
POLICY = RetryPolicy(attempts=2, base=timedelta(seconds=10), cap=timedelta(seconds=15))


class LedgerDown(Exception):
    """A failure of its own kind: the log throttle is per source and exception type."""


class ClockStopped(Exception):
    pass


def deliver(dsn: str, *event_ids: str, ordering: list[Ordering] | None = None) -> None:
    store = InboxStore(schema=SCHEMA)
    with psycopg.connect(dsn) as conn:
        for n, event_id in enumerate(event_ids):  # one by one: arrival order is delivery order
            with conn.transaction():
                body = json.dumps({"order": event_id}).encode()
                order = ordering[n] if ordering else None
                delivery = Delivery("shop", event_id, body, {}, digest(body), order)
                store.store(conn, [delivery], now=T0)


def orders(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT key FROM orders ORDER BY key")]


def inbox(dsn: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT event_id, status, attempts FROM {SCHEMA}.inbox").fetchall()
    return {event_id: (status, attempts) for event_id, status, attempts in rows}


def test_handler_writes_commit_with_done_and_a_failure_commits_nothing_of_its_own(
    dsn: str, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    deliver(dsn, "e1", "boom", "e2")
    seen: list[int] = []

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.payload["order"]))
        session.flush()
        # One transaction for the batch: a handler sees the earlier handlers' writes.
        seen.append(session.scalar(select(func.count()).select_from(Order)) or 0)
        if event.id == "boom":
            raise LedgerDown("the ledger is down")

    with caplog.at_level(logging.WARNING, logger="pgonce.inbox"):
        assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 3
    assert seen == [1, 2, 2]  # boom's row was rolled back with its savepoint before e2 ran
    assert orders(dsn) == ["e1", "e2"]
    assert inbox(dsn) == {"e1": ("done", 0), "boom": ("pending", 1), "e2": ("done", 0)}
    (record,) = [r for r in caplog.records if "boom" in r.getMessage()]
    assert "LedgerDown: the ledger is down" in record.getMessage()
    assert "attempt 1, retry at 2026-01-01 12:00:" in record.getMessage()
    # Its backoff has not run out: nothing is due.
    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 0
    # At the policy's last attempt the event is dead-lettered, and the log says how to replay it.
    with caplog.at_level(logging.ERROR, logger="pgonce.inbox"):
        later = T0 + timedelta(minutes=1)
        assert process_batch(engine, "shop", handle, retry=POLICY, now=later) == 1
    assert inbox(dsn)["boom"] == ("dead", 2)
    assert "pgonce replay --source shop --event-id boom" in caplog.records[-1].getMessage()
    assert orders(dsn) == ["e1", "e2"]


def test_a_write_that_breaks_a_deferred_constraint_fails_its_event_alone(
    dsn: str, engine: Engine
) -> None:
    """Checked only at COMMIT, the broken reference would fail the whole batch, batch after
    batch, and the other events would never commit."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE parents (id int PRIMARY KEY)")
        conn.execute("INSERT INTO parents VALUES (1)")
        conn.execute(
            "CREATE TABLE children (event text, parent int"
            " REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )
    deliver(dsn, "e1", "orphan", "e2")

    def handle(event: InboxEvent, session: Session) -> None:
        parent = 99 if event.id == "orphan" else 1
        session.execute(text("INSERT INTO children VALUES (:e, :p)"), {"e": event.id, "p": parent})
        # Deferred within the handler, as declared: the row may come before its parent.
        session.execute(text("INSERT INTO children VALUES (:e, 2)"), {"e": event.id})
        session.execute(text("INSERT INTO parents VALUES (2) ON CONFLICT DO NOTHING"))

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 3
    assert inbox(dsn) == {"e1": ("done", 0), "orphan": ("pending", 1), "e2": ("done", 0)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        written = conn.execute("SELECT DISTINCT event FROM children ORDER BY event").fetchall()
        (error,) = conn.execute(
            f"SELECT last_error FROM {SCHEMA}.inbox WHERE event_id = 'orphan'"
        ).fetchone() or (None,)
    assert written == [("e1",), ("e2",)]
    assert error.startswith("ForeignKeyViolation")


def test_failures_alike_are_logged_once_a_minute_across_batches(
    dsn: str, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    deliver(dsn, "a", "b")

    def handle(event: InboxEvent, session: Session) -> None:
        raise ClockStopped(event.id)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "ClockStopped" in r.getMessage()]

    policy = RetryPolicy(attempts=5, base=timedelta(seconds=10), cap=timedelta(seconds=15))
    with caplog.at_level(logging.WARNING, logger="pgonce.inbox"):
        assert process_batch(engine, "shop", handle, retry=policy, now=T0) == 2
        assert len(lines()) == 1  # b's failure, alike, is held back
        deliver(dsn, "c")
        assert process_batch(engine, "shop", handle, retry=policy, now=T0) == 1
        assert len(lines()) == 1  # so is c's, in another batch within the minute
        later = T0 + timedelta(minutes=2)
        assert process_batch(engine, "shop", handle, retry=policy, now=later) == 3
    assert len(lines()) == 2
    assert "(2 more like it since the last report)" in lines()[1]
    assert inbox(dsn) == {"a": ("pending", 2), "b": ("pending", 2), "c": ("pending", 2)}


def test_a_handlers_commit_and_rollback_stay_inside_its_event(dsn: str, engine: Engine) -> None:
    deliver(dsn, "kept", "undone")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        if event.id == "undone":
            session.rollback()  # undoes this handler's write, not the batch
        else:
            session.commit()  # releases the handler's savepoint; the batch commits it
        # Still in the batch's transaction: the claim's uncommitted "done" is visible here only.
        assert session.scalar(text(f"SELECT status FROM {SCHEMA}.inbox WHERE event_id = 'kept'"))

    factory = sessionmaker(expire_on_commit=False)
    assert process_batch(engine, "shop", handle, session_factory=factory, now=T0) == 2
    assert orders(dsn) == ["kept"]
    assert inbox(dsn) == {"kept": ("done", 0), "undone": ("done", 0)}


def test_a_handler_that_commits_then_raises_leaves_nothing_of_its_own(
    dsn: str, engine: Engine
) -> None:
    deliver(dsn, "e1")
    calls = 0

    def handle(event: InboxEvent, session: Session) -> None:
        nonlocal calls
        calls += 1
        session.add(Order(key=event.id))
        session.commit()  # releases the session's savepoint, not the event's
        if calls == 1:
            raise LedgerDown("after the commit")

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 1
    assert orders(dsn) == []  # the event's savepoint took the committed write with it
    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0 + timedelta(minutes=1)) == 1
    assert (calls, orders(dsn)) == (2, ["e1"])


def test_outbox_events_of_a_handler_commit_with_its_event(dsn: str, engine: Engine) -> None:
    deliver(dsn, "paid", "refused")

    def handle(event: InboxEvent, session: Session) -> None:
        enqueue(session, "order", event.id, "order.settled", {"order": event.id}, now=T0)
        if event.id == "refused":
            raise ValueError("not this one")

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 2
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = conn.execute(f"SELECT aggregateid FROM {SCHEMA}.outbox").fetchall()
    assert ids == [("paid",)]


def test_drop_skips_an_older_version_and_a_failed_handler_leaves_the_watermark(
    dsn: str, engine: Engine
) -> None:
    deliver(
        dsn,
        "v1",
        "v3",
        "v2",
        "v4",
        ordering=[Ordering("cus_1", v) for v in (1, 3, 2, 4)],
    )
    ran: list[str] = []

    def handle(event: InboxEvent, session: Session) -> None:
        if event.id == "v4" and "v4" not in ran:
            ran.append(event.id)
            raise RuntimeError("first try fails")
        ran.append(event.id)

    while process_batch(engine, "shop", handle, out_of_order="drop", retry=POLICY, now=T0):
        pass
    assert ran == ["v1", "v3", "v4"]  # v2 arrived after v3
    assert inbox(dsn)["v2"] == ("skipped", 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = f"SELECT version FROM {SCHEMA}.inbox_watermarks WHERE ordering_key = 'cus_1'"
        assert conn.execute(query).fetchone() == (3,)  # v4's move was rolled back with it
    # v4's failed run did not move the watermark: its retry runs, and is not dropped as "older".
    later = T0 + timedelta(minutes=1)
    assert process_batch(engine, "shop", handle, out_of_order="drop", now=later) == 1
    assert ran == ["v1", "v3", "v4", "v4"]
    assert inbox(dsn)["v4"] == ("done", 1)


async def test_misuse_is_refused_at_the_call(
    dsn: str, engine: Engine, async_engine: AsyncEngine, tmp_path: Path
) -> None:
    def handle(event: InboxEvent, session: Session) -> None:
        raise AssertionError("no handler runs on a refused call")

    with pytest.raises(UsageError, match="inbox_handler"):
        process_batch(async_engine, "shop", handle)  # type: ignore[arg-type]
    with pytest.raises(NotPsycopgSession, match=r"postgresql\+psycopg://"):
        process_batch(create_engine(f"sqlite:///{tmp_path}/x.db"), "shop", handle)
    with pytest.raises(UsageError, match="at least 1"):
        process_batch(engine, "shop", handle, limit=0)
    with pytest.raises(UsageError, match="'process' or 'drop'"):
        process_batch(engine, "shop", handle, out_of_order="dorp")  # type: ignore[arg-type]
    with pytest.raises(DatabaseUnavailable, match="connecting through the engine failed"):
        process_batch(create_engine("postgresql+psycopg://postgres@127.0.0.1:1/x"), "s", handle)
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    deliver(dsn, "e1")
    with pytest.raises(UsageError, match="transaction"):
        process_batch(autocommit, "shop", handle)
    assert inbox(dsn) == {"e1": ("pending", 0)}


@pytest.mark.slow
def test_kill_9_mid_handler_commits_nothing_and_the_next_batch_runs_it(
    dsn: str, engine: Engine
) -> None:
    deliver(dsn, "evt_k")
    # The child's engine makes no tables: the engine fixture made them.
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.sqlalchemy_adapter.batch_process", dsn],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        # The handler has flushed its row and waits inside the batch's open transaction.
        assert process.stdout.readline().strip() == "STARTED evt_k"
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert inbox(dsn) == {"evt_k": ("pending", 0)}
    assert orders(dsn) == []

    ran: list[str] = []

    def handle(event: InboxEvent, session: Session) -> None:
        ran.append(event.id)
        session.add(Order(key=event.id))

    # PostgreSQL releases the killed backend's row lock when it notices the lost connection; not
    # to wait for that, end the backend, and wait until it is gone (PostgreSQL 14's timeout).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [APPLICATION_NAME],
        )
    assert process_batch(engine, "shop", handle, now=T0) == 1
    assert process_batch(engine, "shop", handle, now=T0) == 0
    assert ran == ["evt_k"]
    assert orders(dsn) == ["evt_k"]
    assert inbox(dsn) == {"evt_k": ("done", 0)}
