"""Producers that write batches of 1,000 events over shared aggregates with ``enqueue_many``, each
batch naming the aggregates in its own shuffled order, while two relays run on the same database
(a relay started twice) and publish to one Redis stream. No producer deadlocks on another's
batch, every event reaches the stream exactly once, and each aggregate's events arrive in the
order their transactions committed, a batch's own events in the order given."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter, defaultdict
from typing import Any

import psycopg

from pgonce import AsyncOutboxStore, OutboxEvent
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import fresh, wait_until

PRODUCERS = 3
BATCHES = 2
EVENTS = 1000
AGGREGATES = 40


async def produce(dsn: str, kind: str, producer: int) -> list[int]:
    store = AsyncOutboxStore()
    ids: list[int] = []
    rng = random.Random(producer)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for batch in range(BATCHES):
            events = [
                OutboxEvent(kind, str(rng.randrange(AGGREGATES)), "e", {"p": producer, "b": batch})
                for _ in range(EVENTS)
            ]
            for n, event in enumerate(events):
                event.payload["n"] = n
            async with conn.transaction():
                ids += await store.enqueue_many(conn, events)
            await asyncio.sleep(0)
    return ids


async def test_batches_of_mixed_aggregates_while_two_relays_run(dsn: str, redis_url: str) -> None:
    kind = fresh("batches-")
    stream = f"outbox.{kind}"
    stop = asyncio.Event()
    relays = [
        Relay(dsn, RedisStreamsPublisher(redis_url), batch_size=100, per_aggregate=5)
        for _ in range(2)
    ]
    running = [asyncio.create_task(relay.run(stop)) for relay in relays]
    try:
        produced = await asyncio.gather(*(produce(dsn, kind, p) for p in range(PRODUCERS)))
        total = PRODUCERS * BATCHES * EVENTS

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher:

            async def all_published() -> bool:
                cur = await watcher.execute(
                    "SELECT count(*) FROM pgonce.outbox WHERE published_at IS NOT NULL"
                )
                return await cur.fetchone() == (total,)

            await wait_until(all_published, within=120)
    finally:
        stop.set()
        await asyncio.gather(*running)
    try:
        received = await redis_read(redis_url, stream)
    finally:
        await redis_delete(redis_url, stream)
    ids = sorted(i for batch in produced for i in batch)
    counts = Counter(int(r.message_id) for r in received)
    assert sorted(counts) == ids
    assert set(counts.values()) == {1}
    # Per aggregate: in id order (commit order), and a batch's events in the order given.
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    given: dict[tuple[str, Any, Any], list[int]] = defaultdict(list)
    for r in received:
        by_aggregate[r.aggregateid].append(int(r.message_id))
        payload = json.loads(r.body)
        given[(r.aggregateid, payload["p"], payload["b"])].append(payload["n"])
    assert all(seq == sorted(seq) for seq in by_aggregate.values())
    assert all(seq == sorted(seq) for seq in given.values())
    assert sum(relay.stats.published for relay in relays) == total
