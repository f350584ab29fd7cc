"""A relay asked to stop while its loops wait for a connection stops at once.

A database server that accepts connections and does not answer (a stalled host, a pooler whose
pool is full) used to hold SIGTERM for as long as libpq's connect timeout, two minutes and more; no
batch is in progress then, so nothing is lost by giving up the connection.

A broker that does the same held the stop for the publisher's connect timeout (RabbitMQ's 5 s),
and up to the relay's stop grace (10 s) for another publisher: a batch waiting in publish() for its
connection counted as at the broker, though nothing of it was sent. Its rows are claimed, and stay
pending with no attempt counted; the next run publishes them.

So did a batch after the broker's connection closed while the relay was idle (a broker restart, an
idle timeout, a cut): the relay took the publisher for connected, and the batch reconnected inside
publish(). The publisher's ``connected`` says it is not, and the batch connects first.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from faults.proxy import Proxy
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import LOOPS_PER_BATCH_IN_FLIGHT, STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import nats_read, nats_stream, rabbitmq_drain, rabbitmq_queue
from tests.outbox.conftest import NATS, RABBITMQ, fresh, wait_until
from tests.outbox.test_probe_stop_while_blocked import cut_lines, pending


async def test_stop_ends_a_relay_whose_database_does_not_answer() -> None:
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = Relay(
        f"postgresql://postgres@127.0.0.1:{port}/test",
        RedisStreamsPublisher("redis://127.0.0.1:9/0"),
        listen=False,
        concurrency=1,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: len(held) >= LOOPS_PER_BATCH_IN_FLIGHT)
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=10)
        assert running in done, "the relay did not stop while connecting"
        running.result()
    finally:
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def in_transaction(dsn: str) -> int:
    """How many connections to the database hold a transaction open between statements: a batch
    loop that claimed its rows and is at its publisher."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction'"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_stop_cancels_batches_waiting_for_a_broker_that_does_not_answer(
    direct_dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue_name = fresh("pgonce-stop-")
    with psycopg.connect(direct_dsn) as conn:
        for aggregate in ("1", "2"):
            enqueue(conn, queue_name, aggregate, "created", {"n": aggregate})
    accepted = 0
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        if accepted == 1:
            # The check at the start fails at once: the loops start without its 5 s.
            writer.close()
            return
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # One row per batch, two batches at the broker at once: both rows are claimed, and both
    # batches wait for the one connect.
    relay = Relay(
        direct_dsn,
        RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{port}/"),
        listen=False,
        concurrency=2,
        batch_size=1,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    loop = asyncio.get_running_loop()
    try:
        await wait_until(lambda: held and in_transaction(direct_dsn) == 2)
        stop.set()
        stopped_at = loop.time()
        # Below the publisher's 5 s connect timeout, which the stop used to wait for.
        done, _ = await asyncio.wait({running}, timeout=STOP_WAIT.total_seconds() + 1)
        assert running in done, "the relay did not stop while its batches waited to connect"
        running.result()
        assert loop.time() - stopped_at < STOP_WAIT.total_seconds() + 1
    finally:
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    # Nothing was sent, so nothing was marked and no attempt counted; no database statement was
    # cut either.
    assert pending(direct_dsn) == (2, 0)
    assert cut_lines(caplog) == []
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        publisher = RabbitMQPublisher(rabbitmq_url)
        try:
            await Relay(direct_dsn, publisher, listen=False).drain()
        finally:
            await publisher.close()
        received = await rabbitmq_drain(queue)
    assert pending(direct_dsn) == (0, None)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        ids = [str(i) for (i,) in conn.execute("SELECT id FROM pgonce.outbox ORDER BY id")]
    assert sorted(r.message_id for r in received) == ids


async def test_stop_cancels_a_batch_reconnecting_after_an_idle_connection_was_cut(
    direct_dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue_name = fresh("pgonce-stop-")
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        with Proxy(tcp=RABBITMQ) as proxy:
            publisher = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{proxy.port}/")
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=1)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, queue_name, "1", "created", {"n": 1})
            stop = asyncio.Event()
            running = asyncio.create_task(relay.run(stop))
            loop = asyncio.get_running_loop()
            try:
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                assert publisher.connected
                # The broker's connection goes while the relay is idle, and the broker then
                # accepts connections and does not answer.
                proxy.hold(True)
                accepted = proxy.accepted
                assert proxy.cut() == 1
                await wait_until(lambda: not publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    enqueue(conn, queue_name, "2", "created", {"n": 2})
                await wait_until(
                    lambda: proxy.accepted > accepted and in_transaction(direct_dsn) == 1
                )
                stop.set()
                stopped_at = loop.time()
                # Below the publisher's 5 s connect timeout, which the stop used to wait for.
                done, _ = await asyncio.wait({running}, timeout=STOP_WAIT.total_seconds() + 1)
                assert running in done, "the relay did not stop while its batch reconnected"
                running.result()
                assert loop.time() - stopped_at < STOP_WAIT.total_seconds() + 1
            finally:
                if not running.done():
                    running.cancel()
                    await asyncio.wait({running})
        assert pending(direct_dsn) == (1, 0)
        assert cut_lines(caplog) == []
        again = RabbitMQPublisher(rabbitmq_url)
        try:
            await Relay(direct_dsn, again, listen=False).drain()
        finally:
            await again.close()
        received = await rabbitmq_drain(queue)
    assert pending(direct_dsn) == (0, None)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        ids = [str(i) for (i,) in conn.execute("SELECT id FROM pgonce.outbox ORDER BY id")]
    assert sorted(r.message_id for r in received) == ids


async def test_stop_cancels_a_nats_batch_reconnecting_after_an_idle_connection_was_cut(
    direct_dsn: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # nats-py sees the cut and says it is no longer connected; the publisher's next batch
    # connects afresh, which used to count as rows at the broker.
    aggregatetype = fresh("stopnats")
    async with nats_stream(nats_url, aggregatetype, [f"outbox.{aggregatetype}"]) as js:
        with Proxy(tcp=NATS) as proxy:
            publisher = NatsPublisher(f"nats://127.0.0.1:{proxy.port}")
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=1)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, aggregatetype, "1", "created", {"n": 1})
            stop = asyncio.Event()
            running = asyncio.create_task(relay.run(stop))
            loop = asyncio.get_running_loop()
            try:
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                assert publisher.connected
                proxy.hold(True)
                accepted = proxy.accepted
                assert proxy.cut() == 1
                await wait_until(lambda: not publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    enqueue(conn, aggregatetype, "2", "created", {"n": 2})
                await wait_until(
                    lambda: proxy.accepted > accepted and in_transaction(direct_dsn) == 1
                )
                stop.set()
                stopped_at = loop.time()
                # Below nats-py's 5 s connect timeout, which the stop used to wait for.
                done, _ = await asyncio.wait({running}, timeout=STOP_WAIT.total_seconds() + 1)
                assert running in done, "the relay did not stop while its batch reconnected"
                running.result()
                assert loop.time() - stopped_at < STOP_WAIT.total_seconds() + 1
            finally:
                if not running.done():
                    running.cancel()
                    await asyncio.wait({running})
        assert pending(direct_dsn) == (1, 0)
        assert cut_lines(caplog) == []
        again = NatsPublisher(nats_url)
        try:
            await Relay(direct_dsn, again, listen=False).drain()
        finally:
            await again.close()
        received = await nats_read(js, aggregatetype)
    assert pending(direct_dsn) == (0, None)
    assert [r.aggregateid for r in received] == ["1", "2"]
