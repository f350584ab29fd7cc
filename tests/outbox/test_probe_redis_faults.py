"""The Redis Streams publisher under the faults a team meets: a key of another type where the
stream should be, its connections killed by the server, a capped stream, a server that accepts
and never answers.

Connections are killed by id (``CLIENT KILL ID``), only the publisher's own, found by a client
name unique to the test: the Redis server is shared.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from redis.asyncio import Redis

from pgonce.errors import BrokerUnavailable
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import fresh, outbox_rows, wait_until


async def test_a_key_of_another_type_is_named_in_the_refusal(redis_url: str) -> None:
    key = fresh("pgonce-test-wrongtype-")
    publisher = RedisStreamsPublisher(redis_url, routing=lambda m: key)
    client = Redis.from_url(redis_url)
    try:
        await client.set(key, "not a stream")
        result = await publisher.publish(outbox_rows(1))
    finally:
        await client.delete(key)
        await client.aclose()
        await publisher.close()
    assert result.acked == frozenset()
    # Which key the operator must look at, and why.
    assert result.refused[1] == (
        f"Redis refused XADD to {key!r}: ResponseError: WRONGTYPE Operation against a key "
        "holding the wrong kind of value"
    )


async def kill_own(url: str, name: str) -> int:
    """Kill, from another client, every connection named ``name``; how many were killed."""
    client = Redis.from_url(url)
    try:
        ids = [c["id"] for c in await client.client_list() if c.get("name") == name]
        for id_ in ids:
            await client.client_kill_filter(_id=id_)
    finally:
        await client.aclose()
    return len(ids)


async def test_connections_the_server_killed_are_replaced_and_each_row_goes_once(
    redis_url: str,
) -> None:
    key = fresh("pgonce-test-killed-")
    name = fresh("pgonce-kill-")
    publisher = RedisStreamsPublisher(f"{redis_url}?client_name={name}", routing=lambda m: key)
    try:
        await publisher.prepare()
        assert (await publisher.publish(outbox_rows(2))).acked == {1, 2}
        assert await kill_own(redis_url, name) >= 1
        # The relay reads this before the batch: False sends it through prepare() first.
        await wait_until(lambda: not publisher.connected)
        await publisher.prepare()
        assert publisher.connected
        assert (await publisher.publish(outbox_rows(2, first=3))).acked == {3, 4}
        received = await redis_read(redis_url, key)
    finally:
        await publisher.close()
        await redis_delete(redis_url, key)
    assert [r.message_id for r in received] == ["1", "2", "3", "4"]


async def test_a_capped_stream_acknowledges_and_keeps_about_maxlen(redis_url: str) -> None:
    key = fresh("pgonce-test-capped-")
    publisher = RedisStreamsPublisher(redis_url, routing=lambda m: key, maxlen=10)
    try:
        for first in range(1, 1001, 100):
            result = await publisher.publish(outbox_rows(100, first=first))
            assert len(result.acked) == 100
            assert not result.refused
        received = await redis_read(redis_url, key)
    finally:
        await publisher.close()
        await redis_delete(redis_url, key)
    # Trimmed from the oldest end (MAXLEN ~ trims by whole nodes, so about 10 stay): the newest
    # entries are the ones kept.
    assert 10 <= len(received) < 1000
    assert received[-1].message_id == "1000"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a server that hangs, or a black hole
    behind a load balancer)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield server.getsockname()[1]


async def test_a_server_that_never_answers_is_unavailable_within_the_timeout(
    silent_port: int,
) -> None:
    # One try, within the timeout: redis-py's clients made from a URL do not retry by
    # themselves (a retry would multiply the wait, and send a pipeline's XADDs again), and
    # the relay's outage backoff does the retrying, saying so.
    publisher = RedisStreamsPublisher(
        f"redis://127.0.0.1:{silent_port}/0", timeout=timedelta(milliseconds=300)
    )
    try:
        for attempt in (publisher.prepare, lambda: publisher.publish(outbox_rows(1))):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="Timeout"):
                await attempt()
            assert time.monotonic() - started < 1.5
    finally:
        await publisher.close()
