"""A Redis connection closed while the relay is idle is connected again before the next batch
(a stop while it connects: tests/outbox/test_probe_stop_while_connecting.py, with the other
brokers).

redis-py learns of it only in the next command: that batch was lost at once ("Connection closed
by server"), taken for an outage (a warning, and its rows waited a backoff of up to 10 s), or, where
redis-py reconnects inside the command, reconnected inside publish(), which a stop waits for as rows
at the broker (up to the relay's stop grace, 10 s). The publisher's ``connected`` reads what
asyncio already read from the idle connection (the server's end of file, or a reset), so the batch
connects first, which a stop cancels at once. On a healthy connection it says True for every
batch: no batch connects again.
"""

from __future__ import annotations

import logging

import psycopg
import pytest

from faults.proxy import Proxy
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import REDIS, fresh, wait_until
from tests.outbox.stops import running
from tests.outbox.test_probe_stop_while_blocked import pending


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What pgonce logged at WARNING and above: a lost batch is said there as an outage."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("pgonce") and r.levelno >= logging.WARNING
    ]


class Counting(RedisStreamsPublisher):
    """Counts the relay's prepare() calls and its reads of ``connected``."""

    prepares = 0
    checks = 0

    async def prepare(self) -> None:
        self.prepares += 1
        await super().prepare()

    @property
    def connected(self) -> bool:
        self.checks += 1
        return super().connected


async def test_a_redis_batch_after_an_idle_cut_reconnects_and_publishes(
    direct_dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The same cut with the server answering: the batch connects again and its row goes at
    # its first try, with no outage said.
    aggregatetype = fresh("cutredis")
    stream = f"outbox.{aggregatetype}"
    try:
        with Proxy(tcp=REDIS) as proxy:
            publisher = Counting(f"redis://127.0.0.1:{proxy.port}/0")
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=1)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, aggregatetype, "1", "created", {"n": 1})
            async with running(relay) as run:
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                accepted = proxy.accepted
                assert proxy.cut() == 1
                await wait_until(lambda: not publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    enqueue(conn, aggregatetype, "2", "created", {"n": 2})
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                assert publisher.prepares == 2
                assert proxy.accepted == accepted + 1
                assert publisher.connected
                assert warnings(caplog) == []
                await run.stop_within(10, "the relay did not stop")
        assert [r.aggregateid for r in await redis_read(redis_url, stream)] == ["1", "2"]
    finally:
        await redis_delete(redis_url, stream)


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_healthy_redis_connection_is_never_taken_for_closed(
    direct_dsn: str, redis_url: str, concurrency: int, caplog: pytest.LogCaptureFixture
) -> None:
    aggregatetype = fresh("healthyredis")
    stream = f"outbox.{aggregatetype}"
    rows = 60
    try:
        with Proxy(tcp=REDIS) as proxy:
            publisher = Counting(f"redis://127.0.0.1:{proxy.port}/0")
            # One row per batch: as many batches as rows, each asking ``connected``.
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=concurrency, batch_size=1)
            async with running(relay) as run:
                await wait_until(lambda: publisher.prepares == 1 and publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    for n in range(rows):
                        enqueue(conn, aggregatetype, str(n), "created", {"n": n})
                await wait_until(lambda: pending(direct_dsn) == (0, None), within=30)
                await run.stop_within(10, "the relay did not stop")
            # Every batch asked, and none connected again: the pool's connections stayed the
            # ones made by the start's prepare() and, with two batches at once, by publish().
            assert publisher.checks >= rows
            assert publisher.prepares == 1
            assert proxy.cut_connections == 0
            assert proxy.accepted <= concurrency
            assert warnings(caplog) == []
        received = await redis_read(redis_url, stream)
        assert sorted(int(r.aggregateid) for r in received) == list(range(rows))
    finally:
        await redis_delete(redis_url, stream)
