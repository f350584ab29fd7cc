"""A Redis server that refuses the connection's set-up (a database number it does not have) is
an unavailable broker: the batch waits unsettled, no attempt counted, and the relay says so in its
one line about the outage. The ResponseError used to escape the publisher and fail every batch as a
bug of the relay, with a traceback."""

from __future__ import annotations

import psycopg
import pytest

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import REDIS


async def test_a_database_number_the_server_lacks_leaves_the_batch_waiting(
    dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(dsn) as producer:
        enqueue(producer, "order", "1", "created", {"n": 1})
        producer.commit()
    publisher = RedisStreamsPublisher(f"redis://{REDIS[0]}:{REDIS[1]}/9999")
    relay = Relay(dsn, publisher, listen=False)
    conn = await relay.connect(dsn)
    try:
        report = await relay.run_once(conn)
    finally:
        await conn.close()
        await publisher.close()
    assert report.broker_down
    assert report.claimed == 1
    assert relay.stats.failures == {"unavailable": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]
    assert any("DB index is out of range" in line for line in lines), lines
    with psycopg.connect(dsn) as check:
        row = check.execute(
            "select published_at, attempts from pgonce.outbox where aggregateid = '1'"
        ).fetchone()
    assert row == (None, 0)
