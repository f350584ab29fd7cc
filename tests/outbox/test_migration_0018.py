"""Migration 0018 (room on the lock rows' pages): the lock rows from before it are kept, and
the events enqueued before and after it are relayed in order per aggregate."""

from __future__ import annotations

import psycopg

from pgonce import sql as pgsql
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from pgonce.store.migrate import _apply_one, migrate
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import fresh
from tests.outbox.test_relay import assert_in_order_per_aggregate

AGGREGATES = 5
BEFORE = 40
AFTER = 40


async def test_events_enqueued_before_0018_are_relayed_in_order_after_it(
    empty_dsn: str, redis_url: str
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for m in pgsql.migrations():
            if m.version < 18:
                _apply_one(conn, "pgonce", m.text, m.version, m.name)
        with conn.transaction():
            for n in range(BEFORE):
                enqueue(conn, "order", str(n % AGGREGATES), "e", {"seq": n // AGGREGATES})
        # 0018 and every migration after it.
        assert migrate(conn, "pgonce") == [m.version for m in pgsql.migrations() if m.version >= 18]
        assert conn.execute(
            "SELECT reloptions FROM pg_class WHERE oid = 'pgonce.outbox_aggregates'::regclass"
        ).fetchone() == (["fillfactor=80"],)
        # The lock rows were kept: each aggregate's next event counts on its row.
        with conn.transaction():
            for n in range(BEFORE, BEFORE + AFTER):
                enqueue(conn, "order", str(n % AGGREGATES), "e", {"seq": n // AGGREGATES})
        assert conn.execute(
            "SELECT array_agg(DISTINCT events) FROM pgonce.outbox_aggregates"
        ).fetchone() == ([(BEFORE + AFTER) // AGGREGATES],)
    key = fresh("pgonce-test-")
    relay = Relay(empty_dsn, RedisStreamsPublisher(redis_url, routing=lambda m: key), batch_size=7)
    try:
        stats = await relay.drain()
        received = await redis_read(redis_url, key)
    finally:
        await relay.publisher.close()
        await redis_delete(redis_url, key)
    assert stats.published == BEFORE + AFTER
    assert len({r.message_id for r in received}) == BEFORE + AFTER
    assert_in_order_per_aggregate(received)
