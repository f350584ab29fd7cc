"""A Redis connection closed while the relay is idle is connected again before the next batch.

redis-py learns of it only in the next command: that batch was lost at once ("Connection closed
by server"), taken for an outage (a warning, and its rows waited a backoff of up to 10 s), or, where
redis-py reconnects inside the command, reconnected inside publish(), which a stop waits for as rows
at the broker (up to the relay's stop grace, 10 s). The publisher's ``connected`` reads what
asyncio already read from the idle connection (the server's end of file, or a reset), so the batch
connects first, which a stop cancels at once. On a healthy connection it says True for every
batch: no batch connects again.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from faults.proxy import Proxy
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import REDIS, fresh, wait_until
from tests.outbox.test_probe_stop_while_blocked import cut_lines, pending
from tests.outbox.test_probe_stop_while_connecting import in_transaction


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


async def test_stop_cancels_a_redis_batch_reconnecting_after_an_idle_connection_was_cut(
    direct_dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    aggregatetype = fresh("stopredis")
    stream = f"outbox.{aggregatetype}"
    try:
        with Proxy(tcp=REDIS) as proxy:
            publisher = Counting(f"redis://127.0.0.1:{proxy.port}/0")
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=1)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, aggregatetype, "1", "created", {"n": 1})
            stop = asyncio.Event()
            running = asyncio.create_task(relay.run(stop))
            loop = asyncio.get_running_loop()
            try:
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                assert publisher.connected
                assert publisher.prepares == 1
                # The server's connection goes while the relay is idle, and the server then
                # accepts connections and does not answer.
                proxy.hold(True)
                accepted = proxy.accepted
                assert proxy.cut() == 1
                await wait_until(lambda: not publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    enqueue(conn, aggregatetype, "2", "created", {"n": 2})
                # The batch connects first (a prepare() of its own), through the held proxy.
                await wait_until(
                    lambda: (
                        publisher.prepares == 2
                        and proxy.accepted > accepted
                        and in_transaction(direct_dsn) == 1
                    )
                )
                stop.set()
                stopped_at = loop.time()
                # Below the relay's 10 s stop grace, which the stop used to wait for.
                done, _ = await asyncio.wait({running}, timeout=STOP_WAIT.total_seconds() + 1)
                assert running in done, "the relay did not stop while its batch reconnected"
                running.result()
                assert loop.time() - stopped_at < STOP_WAIT.total_seconds() + 1
            finally:
                if not running.done():
                    running.cancel()
                    await asyncio.wait({running})
        # Nothing of the batch was sent: the row waits, with no attempt counted.
        assert pending(direct_dsn) == (1, 0)
        assert cut_lines(caplog) == []
        assert warnings(caplog) == []
        assert [r.aggregateid for r in await redis_read(redis_url, stream)] == ["1"]
        again = RedisStreamsPublisher(redis_url)
        try:
            await Relay(direct_dsn, again, listen=False).drain()
        finally:
            await again.close()
        assert pending(direct_dsn) == (0, None)
        assert [r.aggregateid for r in await redis_read(redis_url, stream)] == ["1", "2"]
    finally:
        await redis_delete(redis_url, stream)


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
            stop = asyncio.Event()
            running = asyncio.create_task(relay.run(stop))
            try:
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
            finally:
                stop.set()
                await asyncio.wait_for(running, timeout=10)
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
            stop = asyncio.Event()
            running = asyncio.create_task(relay.run(stop))
            try:
                await wait_until(lambda: publisher.prepares == 1 and publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    for n in range(rows):
                        enqueue(conn, aggregatetype, str(n), "created", {"n": n})
                await wait_until(lambda: pending(direct_dsn) == (0, None), within=30)
            finally:
                stop.set()
                await asyncio.wait_for(running, timeout=10)
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
