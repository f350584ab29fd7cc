"""An entry with a field above the Redis server's ``proto-max-bulk-len`` is refused before it is
sent, as the NATS and RabbitMQ publishers refuse what their broker cannot take: it counts attempts
and is parked in the end, while the rest of the batch is published once. Redis answers such a
command by closing the connection, which the publisher used to take for an outage: every batch
that held the row failed as "unavailable", never parked, and the rows sent before it in the
pipeline were appended again at every retry."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import psycopg
import pytest
from redis import Redis

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import fresh

#: Redis's smallest allowed proto-max-bulk-len.
LIMIT = 1024 * 1024


def start_redis(port: int) -> subprocess.Popen[str] | None:
    """A throwaway Redis on ``port`` with the smallest bulk limit, once it says it is ready;
    None when the port is taken."""
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--proto-max-bulk-len",
            "1mb",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert server.stdout is not None
    for line in server.stdout:
        if "Ready to accept connections" in line:
            return server
    server.wait()
    return None


@pytest.fixture
def small_redis() -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    for port in range(6390, 6400):
        server = start_redis(port)
        if server is not None:
            break
    else:
        pytest.skip("no free port for a Redis of its own in 6390-6399")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()


async def test_an_entry_above_the_bulk_limit_is_refused_and_the_rest_published_once(
    dsn: str, small_redis: str
) -> None:
    stream = fresh("outbox.big")
    with psycopg.connect(dsn) as producer:
        enqueue(producer, "order", "1", "created", {"n": 1})
        enqueue(producer, "order", "2", "created", {"blob": "x" * (2 * LIMIT)})
        enqueue(producer, "order", "2", "shipped", {"n": 3})
        enqueue(producer, "order", "3", "created", {"n": 4})
        producer.commit()
    publisher = RedisStreamsPublisher(small_redis, routing=lambda _message: stream)
    relay = Relay(dsn, publisher, listen=False)
    conn = await relay.connect(dsn)
    try:
        first = await relay.run_once(conn)
        again = await relay.run_once(conn)
    finally:
        await conn.close()
        await publisher.close()
    assert not first.broker_down
    assert (first.published, first.refused) == (2, 1)
    assert relay.stats.failures == {"too_large": 1}
    # The refused row waits for its retry, and the row behind it for it: nothing is due.
    assert again.claimed == 0
    with Redis.from_url(small_redis) as redis:
        assert redis.xlen(stream) == 2
    with psycopg.connect(dsn) as check:
        rows = check.execute(
            "select aggregateid, type, published_at is not null, attempts, last_error"
            " from pgonce.outbox order by id"
        ).fetchall()
    assert [row[:4] for row in rows] == [
        ("1", "created", True, 0),
        ("2", "created", False, 1),
        ("2", "shipped", False, 0),
        ("3", "created", True, 0),
    ]
    assert "proto-max-bulk-len of 1048576 bytes" in rows[1][4]
