"""The metrics' backlog queries count what the full counts count, without the handled rows.

/metrics runs them at every scrape (src/pgonce/service/app.py): they read the partial indexes of
pending and dead-lettered rows (tests/test_indexes.py holds them to that), so these tests hold
them to the same answers as the full counts that a person's page still runs.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgonce import OutboxStore
from pgonce.core.outbox import OutboxBacklog
from pgonce.store._sync.inspect import Inspector

# Two sources, every status; dead letters and pending events with and without an ordering key.
INBOX = """
    INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at, status,
                              next_attempt_at, ordering_key, processed_at)
    SELECT src, g::text, '{}', '{}', sha256((src || g)::bytea), now() - g * interval '1 minute',
           st, now(), CASE WHEN g % 2 = 0 THEN (g % 7)::text END,
           CASE WHEN st = 'pending' THEN NULL ELSE now() END
      FROM generate_series(1, 300) AS g,
           unnest(ARRAY['github', 'shop']) AS src,
           LATERAL (SELECT (ARRAY['pending', 'done', 'done', 'dead', 'skipped', 'done'])
                           [1 + (g + length(src)) % 6]) AS s(st)
     WHERE src = 'github' OR g % 3 <> 0"""

# Pending (a third of them waiting out a backoff), parked and published rows.
OUTBOX = """
    INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, created_at,
                               published_at, parked_at, next_attempt_at)
    SELECT 'order', (g % 40)::text, 'order.created', '{}', now() - g * interval '1 second',
           CASE WHEN g % 5 > 1 THEN now() END,
           CASE WHEN g % 5 = 1 THEN now() END,
           now() + CASE WHEN g % 3 = 0 THEN interval '1 hour' ELSE interval '0' END
      FROM generate_series(1, 500) AS g"""


def test_the_inbox_backlog_is_the_overview_without_handled_events(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute(INBOX)
    inspector = Inspector()
    overview = inspector.inbox_overview(conn)
    backlog = inspector.inbox_backlog(conn)
    assert {row.status for row in overview} == {"pending", "done", "dead", "skipped"}
    assert {(row.source, row.status) for row in backlog} == {
        (source, status) for source in ("github", "shop") for status in ("pending", "dead")
    }
    assert backlog == [row for row in overview if row.status in ("pending", "dead")]


def test_the_outbox_backlog_is_the_counts_without_published_rows(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute(OUTBOX)
    store = OutboxStore()
    counts = store.counts(conn)
    assert min(counts.pending, counts.waiting, counts.parked, counts.published) > 0
    assert counts.waiting < counts.pending
    assert store.backlog(conn) == OutboxBacklog(
        counts.pending, counts.waiting, counts.parked, counts.oldest_pending
    )


def test_table_sizes_are_postgresql_s_estimates_and_absent_until_known(dsn: str) -> None:
    inspector = Inspector()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(INBOX)
        conn.execute(OUTBOX)
        # Never vacuumed or analyzed (and untouched, so autovacuum has no reason to): PostgreSQL
        # has no estimate, and none is made up.
        assert "keys" not in inspector.table_estimates(conn)
        conn.execute("ANALYZE pgonce.keys, pgonce.inbox, pgonce.outbox")
        exact = {}
        for table in ("keys", "inbox", "outbox"):
            row = conn.execute(f"SELECT count(*) FROM pgonce.{table}".encode()).fetchone()
            assert row is not None
            exact[table] = row[0]
        # ANALYZE reads every row of a table this small: the estimate is the count.
        assert inspector.table_estimates(conn) == exact
        assert exact["keys"] == 0
        assert exact["inbox"] > 0
        assert exact["outbox"] == 500
