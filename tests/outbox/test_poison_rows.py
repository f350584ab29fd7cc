"""Rows a broker or endpoint can never take: each is refused on its own (an attempt counted,
parked in the end) and never stalls the relay's other rows, nor jumps ahead of its aggregate."""

from __future__ import annotations

from typing import Any

import psycopg

from pgonce.core.outbox import RetryPolicy
from pgonce.publishers.nats import NatsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import nats_read, nats_stream
from tests.outbox.conftest import fresh

#: One attempt: a refused row is parked at once, so that one drain shows where it ends.
PARK_AT_ONCE = RetryPolicy(max_attempts=1)


def rows(dsn: str) -> dict[int, tuple[Any, ...]]:
    """Every outbox row by id: (published, parked, attempts, last_error)."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT id, published_at IS NOT NULL, parked_at IS NOT NULL, attempts, last_error"
            " FROM pgonce.outbox"
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in found}


async def test_a_payload_above_nats_max_payload_is_refused_and_the_rest_goes_on(
    dsn: str, nats_url: str
) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    with psycopg.connect(dsn) as conn:
        big = enqueue(conn, "order", "1", "e", "x" * (2 * 1024 * 1024))
        behind = enqueue(conn, "order", "1", "e", {"n": 2})
        other = enqueue(conn, "order", "2", "e", {"n": 3})
        conn.commit()
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
        relay = Relay(
            dsn,
            NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}"),
            policy=PARK_AT_ONCE,
        )
        try:
            await relay.drain()
            after_first = rows(dsn)
            await relay.drain()
        finally:
            await relay.publisher.close()
        received = await nats_read(js, stream)
    # The big row is refused and parked, with a reason a person can act on; the other aggregate
    # was published in the same batch; the big row's successor waited for it to be settled.
    assert after_first[big][:3] == (False, True, 1)
    assert "max_payload" in after_first[big][3]
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert [int(r.message_id) for r in received] == [other, behind]
