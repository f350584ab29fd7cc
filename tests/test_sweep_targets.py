"""The inbox and outbox sweep targets: only finished rows go, each by its own age and retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce.core.retention import Retention, RetentionPolicy, SweepLimits
from pgonce.store._sync.health import HealthCheck
from pgonce.store._sync.sweeper import Sweeper

NOW = datetime(2026, 6, 1, tzinfo=UTC)
DAY = timedelta(days=1)
FAST = SweepLimits(batch_size=3, pause=timedelta(0))


def add_event(
    conn: psycopg.Connection[Any], source: str, event_id: str, status: str, age: timedelta
) -> None:
    received = NOW - age
    conn.execute(
        """INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at, status,
                                     next_attempt_at, processed_at)
           VALUES (%s, %s, '{}', '{}', %s, %s, %s, %s, %s)""",
        (source, event_id, b"\x00" * 32, received, status, received,
         None if status == "pending" else received),
    )  # fmt: skip


def remaining(conn: psycopg.Connection[Any], query: str) -> set[str]:
    return {row[0] for row in conn.execute(query)}


def sweep(dsn: str, *policies: RetentionPolicy, targets: list[str]) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return Sweeper(policies, targets=targets, limits=FAST).sweep(conn, now=NOW).deleted


def test_inbox_keeps_pending_and_dead_events_and_honours_each_sources_retention(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for status in ("done", "skipped", "pending", "dead"):
            add_event(conn, "stripe", f"old-{status}", status, 40 * DAY)
            add_event(conn, "stripe", f"new-{status}", status, 1 * DAY)
        add_event(conn, "github", "gh-10d", "done", 10 * DAY)
        add_event(conn, "github", "gh-2d", "done", 2 * DAY)
    policy = RetentionPolicy(
        "inbox", Retention(30 * DAY, 3 * DAY), {"github": Retention(7 * DAY, 1 * DAY)}
    )
    assert sweep(dsn, policy, targets=["inbox"]) == 3
    with psycopg.connect(dsn) as conn:
        left = remaining(conn, "SELECT event_id FROM pgonce.inbox")
    assert left == {
        "old-pending", "old-dead", "new-done", "new-skipped", "new-pending", "new-dead", "gh-2d",
    }  # fmt: skip


def test_outbox_deletes_published_rows_only_and_idle_aggregates(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = [
            ("published-old", NOW - 10 * DAY, None),
            ("published-new", NOW - 1 * DAY, None),
            ("pending-old", None, None),
            ("parked-old", None, NOW - 10 * DAY),
        ]
        for aggregate, published, parked in rows:
            conn.execute(
                """INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, created_at,
                                              published_at, parked_at)
                   VALUES ('order', %s, 'order.created', '{}', %s, %s, %s)""",
                (aggregate, NOW - 20 * DAY, published, parked),
            )
            conn.execute(
                """INSERT INTO pgonce.outbox_aggregates
                       (aggregatetype, aggregateid, events, last_enqueued_at)
                   VALUES ('order', %s, 1, %s)""",
                (aggregate, NOW - 20 * DAY),
            )
    keep = Retention(7 * DAY, timedelta(0))
    deleted = sweep(
        dsn,
        RetentionPolicy("outbox", keep),
        RetentionPolicy("outbox_aggregates", keep),
        targets=["outbox", "outbox_aggregates"],
    )
    with psycopg.connect(dsn) as conn:
        rows_left = remaining(conn, "SELECT aggregateid FROM pgonce.outbox")
        aggregates_left = remaining(conn, "SELECT aggregateid FROM pgonce.outbox_aggregates")
    assert rows_left == {"published-new", "pending-old", "parked-old"}
    # An aggregate goes once nothing of it waits: the published ones' lock rows are idle.
    assert aggregates_left == {"pending-old", "parked-old"}
    assert deleted == 3


def test_health_reads_the_inbox_horizon_by_source(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        add_event(conn, "stripe", "a", "done", 40 * DAY)
        add_event(conn, "stripe", "b", "done", 5 * DAY)
    policy = RetentionPolicy(
        "inbox", Retention(30 * DAY, 3 * DAY), {"stripe": Retention(30 * DAY, 3 * DAY)}
    )
    with psycopg.connect(dsn) as conn:
        report = HealthCheck([policy], targets=["inbox"]).check(conn, now=NOW)
    stripe = next(g for g in report.groups if g.scope == "stripe")
    assert (stripe.oldest_age, stripe.overdue) == (40 * DAY, 1)
