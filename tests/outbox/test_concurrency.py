"""Three relay processes against 10,000 rows: every row is published exactly once, per-aggregate
order holds, and no relay waits on another. Counted on the broker's side."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import psycopg
import pytest

from tests.outbox.brokers import rabbitmq_drain, rabbitmq_queue
from tests.outbox.conftest import fresh
from tests.outbox.processes import go, read_line, start_relay
from tests.outbox.test_relay import assert_in_order_per_aggregate, fill

ROWS = 10_000
# 20 events per aggregate: enough aggregates that three relays always find work.
AGGREGATES = 500


@pytest.mark.slow
async def test_three_relays_publish_10000_rows_exactly_once_in_order(
    dsn: str, rabbitmq_url: str
) -> None:
    ids = await asyncio.to_thread(fill, dsn, ROWS, AGGREGATES)
    name = fresh("pgonce-test-")
    async with rabbitmq_queue(rabbitmq_url, name) as queue:
        relays = await asyncio.gather(
            *(start_relay(dsn, "rabbitmq", rabbitmq_url, name, "--wait-go") for _ in range(3))
        )
        for relay in relays:
            await go(relay)
        totals = []
        for relay in relays:
            totals.append(json.loads(await read_line(relay, within=120))["published"])
            assert await relay.wait() == 0
        received = await rabbitmq_drain(queue)
    # Each relay did a share of the work (none was blocked out), and together exactly all.
    assert sum(totals) == ROWS
    assert all(t > 0 for t in totals), totals
    counts = Counter(int(r.message_id) for r in received)
    assert len(received) == ROWS
    assert sorted(counts) == ids
    assert set(counts.values()) == {1}
    assert_in_order_per_aggregate(received)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pgonce.outbox WHERE published_at IS NULL"
        ).fetchone() == (0,)


@pytest.mark.slow
async def test_three_relays_on_three_hot_aggregates_keep_each_aggregate_in_order(
    dsn: str, rabbitmq_url: str
) -> None:
    """Few aggregates, many events each: the relays contend for every aggregate's head."""
    ids = await asyncio.to_thread(fill, dsn, 3000, 3)
    name = fresh("pgonce-test-")
    async with rabbitmq_queue(rabbitmq_url, name) as queue:
        relays = await asyncio.gather(
            *(
                start_relay(dsn, "rabbitmq", rabbitmq_url, name, "--wait-go", "--batch-size", "20")
                for _ in range(3)
            )
        )
        for relay in relays:
            await go(relay)
        totals = []
        for relay in relays:
            totals.append(json.loads(await read_line(relay, within=120))["published"])
            assert await relay.wait() == 0
        received = await rabbitmq_drain(queue)
    assert sum(totals) == 3000
    assert sorted(int(r.message_id) for r in received) == ids
    assert_in_order_per_aggregate(received)
