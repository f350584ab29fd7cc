"""Faults: a relay killed with SIGKILL between publishing and marking, a relay killed at a random
moment, and a broker taken away mid-run. Every row is delivered; duplicates only where an
acknowledgement was lost, and then with the same message id."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from faults.proxy import Proxy
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.relay import Relay
from tests.outbox.brokers import (
    Received,
    nats_read,
    nats_stream,
    rabbitmq_drain,
    rabbitmq_queue,
    redis_delete,
    redis_read,
)
from tests.outbox.conftest import NATS, RABBITMQ, fresh, wait_until
from tests.outbox.processes import read_line, start_relay
from tests.outbox.test_publishers import batch
from tests.outbox.test_relay import assert_in_order_per_aggregate, fill, pending_rows


def first_occurrences(received: list[Received]) -> list[Received]:
    seen: set[str] = set()
    out = []
    for r in received:
        if r.message_id not in seen:
            seen.add(r.message_id)
            out.append(r)
    return out


async def kill(process: asyncio.subprocess.Process) -> None:
    os.kill(process.pid, signal.SIGKILL)
    assert await process.wait() == -signal.SIGKILL


async def test_relay_killed_after_publishing_before_marking_redelivers_with_same_ids(
    dsn: str, redis_url: str
) -> None:
    key = fresh("pgonce-test-")
    ids = await asyncio.to_thread(fill, dsn, 500, 10)
    try:
        victim = await start_relay(
            dsn, "redis", redis_url, key, "--hang-after", "2", "--batch-size", "100"
        )
        # The second batch is on the broker, acknowledged, and not marked: kill now.
        in_limbo = json.loads(await read_line(victim))
        assert len(in_limbo) == 100
        await kill(victim)
        # The killed relay's transaction rolled back: its batch is pending again.
        assert {row[0] for row in pending_rows(dsn)} >= set(in_limbo)
        survivor = await start_relay(dsn, "redis", redis_url, key)
        assert json.loads(await read_line(survivor))["published"] == 400
        assert await survivor.wait() == 0
        received = await redis_read(redis_url, key)
    finally:
        await redis_delete(redis_url, key)
    counts = Counter(int(r.message_id) for r in received)
    assert sorted(counts) == ids, "every row reached the broker"
    assert {i for i, n in counts.items() if n > 1} == set(in_limbo)
    assert set(counts.values()) == {1, 2}
    assert_in_order_per_aggregate(first_occurrences(received))
    assert pending_rows(dsn) == []


@pytest.mark.slow
async def test_relay_killed_at_a_random_moment_loses_nothing(dsn: str, rabbitmq_url: str) -> None:
    name = fresh("pgonce-test-")
    ids = await asyncio.to_thread(fill, dsn, 3000, 50)
    async with rabbitmq_queue(rabbitmq_url, name) as queue:
        victim = await start_relay(dsn, "rabbitmq", rabbitmq_url, name, "--batch-size", "50")

        async def some_arrived() -> bool:
            declared = await queue.channel.declare_queue(name, passive=True)
            return (declared.declaration_result.message_count or 0) >= 300

        await wait_until(some_arrived, within=30)
        await kill(victim)
        survivor = await start_relay(dsn, "rabbitmq", rabbitmq_url, name)
        await read_line(survivor)
        assert await survivor.wait() == 0
        received = await rabbitmq_drain(queue)
    counts = Counter(int(r.message_id) for r in received)
    assert sorted(counts) == ids
    # At most the batch in flight at the kill arrives twice.
    assert sum(n - 1 for n in counts.values()) <= 50
    assert_in_order_per_aggregate(first_occurrences(received))


async def test_rabbitmq_taken_away_mid_run_and_back_delivers_every_row(
    dsn: str, rabbitmq_url: str
) -> None:
    name = fresh("pgonce-test-")
    ids = await asyncio.to_thread(fill, dsn, 2000, 40)
    with Proxy(tcp=RABBITMQ) as proxy:
        relay = Relay(
            dsn,
            RabbitMQPublisher(
                f"amqp://guest:guest@127.0.0.1:{proxy.port}/", routing=lambda m: name
            ),
            batch_size=50,
            outage_backoff=(timedelta(milliseconds=20), timedelta(milliseconds=200)),
        )
        stop = asyncio.Event()
        async with rabbitmq_queue(rabbitmq_url, name) as queue:
            running = asyncio.create_task(relay.run(stop))
            try:
                await wait_until(lambda: relay.stats.published >= 300, within=30)
                # The broker goes away: open connections are cut, new ones reset at once.
                proxy.refuse(True)
                # The relay notices: batches come back unsettled or the connection is refused.
                await wait_until(lambda: relay.stats.unsettled > 0, within=30)
                published_while_down = relay.stats.published
                assert len(pending_rows(dsn)) > 0
                proxy.refuse(False)
                await wait_until(lambda: not pending_rows(dsn), within=60)
            finally:
                stop.set()
                await running
            received = await rabbitmq_drain(queue)
        assert relay.stats.published > published_while_down
        counts = Counter(int(r.message_id) for r in received)
        assert sorted(counts) == ids
        assert_in_order_per_aggregate(first_occurrences(received))


async def test_nats_taken_away_mid_run_and_back_stores_every_row_once(
    dsn: str, nats_url: str
) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    ids = await asyncio.to_thread(fill, dsn, 2000, 40)
    with Proxy(tcp=NATS) as proxy:
        relay = Relay(
            dsn,
            NatsPublisher(f"nats://127.0.0.1:{proxy.port}", routing=lambda m: f"{prefix}.order"),
            batch_size=50,
            outage_backoff=(timedelta(milliseconds=20), timedelta(milliseconds=200)),
        )
        stop = asyncio.Event()
        async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
            running = asyncio.create_task(relay.run(stop))
            try:
                await wait_until(lambda: relay.stats.published >= 300, within=30)
                proxy.refuse(True)
                await wait_until(lambda: relay.stats.unsettled > 0, within=30)
                proxy.refuse(False)
                await wait_until(lambda: not pending_rows(dsn), within=60)
            finally:
                stop.set()
                await running
            stored = await nats_read(js, stream)
        # JetStream dropped the republished ones by Nats-Msg-Id: exactly once on the stream.
        counts = Counter(int(r.message_id) for r in stored)
        assert sorted(counts) == ids
        assert set(counts.values()) == {1}
        assert_in_order_per_aggregate(stored)


@contextlib.asynccontextmanager
async def nats_behind_proxy(
    nats_url: str, ack_timeout: timedelta
) -> AsyncIterator[tuple[Proxy, NatsPublisher, Any, str]]:
    """A fresh stream, and a connected publisher that reaches NATS through a proxy."""
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    with Proxy(tcp=NATS) as proxy:
        publisher = NatsPublisher(
            f"nats://127.0.0.1:{proxy.port}",
            routing=lambda m: f"{prefix}.order",
            ack_timeout=ack_timeout,
        )
        async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
            try:
                await publisher.publish([])  # connected while answers still flow
                yield proxy, publisher, js, stream
            finally:
                proxy.hold(False)
                await publisher.close()


async def test_nats_pubacks_that_never_come_leave_the_batch_unsettled(nats_url: str) -> None:
    messages = batch("order")
    async with nats_behind_proxy(nats_url, timedelta(milliseconds=300)) as (
        proxy,
        publisher,
        js,
        stream,
    ):
        proxy.hold(True)
        result = await publisher.publish(messages)
        proxy.hold(False)
        # The stream has them, the relay does not know: unsettled, and the next batch goes out
        # on a new connection with the same Nats-Msg-Id.
        assert (result.acked, result.refused) == (frozenset(), {})
        again = await publisher.publish(messages)
        stored = await nats_read(js, stream)
    assert again.acked == {m.id for m in messages}
    assert [int(r.message_id) for r in stored] == [m.id for m in messages]


async def test_nats_connection_lost_while_awaiting_pubacks_releases_the_batch_at_once(
    nats_url: str,
) -> None:
    async with nats_behind_proxy(nats_url, timedelta(minutes=5)) as (proxy, publisher, js, stream):
        proxy.hold(True)
        waiting = asyncio.create_task(publisher.publish(batch("order")))

        async def stored_all() -> bool:
            return bool((await js.stream_info(stream)).state.messages == 5)

        await wait_until(stored_all)
        proxy.cut()
        # Not the five minutes of the ack timeout: the closed connection ends the wait.
        result = await asyncio.wait_for(waiting, timeout=30)
    assert (result.acked, result.refused) == (frozenset(), {})
