"""Concurrent producers of ONE aggregate, each in a process of its own, while two relays publish:
the aggregate's events are published exactly once, in id order, and id order is commit order."""

from __future__ import annotations

import asyncio
import bisect
import json
import sys
from typing import Any

import pytest

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from tests.outbox.brokers import redis_delete, redis_read
from tests.outbox.conftest import fresh
from tests.outbox.processes import ROOT

PRODUCERS = 4
TRANSACTIONS = 60


async def start_producer(dsn: str, aggregate: str, number: int, *extra: str) -> Any:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.outbox.producer_process",
        dsn,
        aggregate,
        str(number),
        str(TRANSACTIONS),
        *extra,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
    assert line.strip() == b"ready", line
    return process


async def produce(dsn: str, aggregate: str, *extra: str) -> list[dict[str, Any]]:
    """Run the producers at once; every transaction they committed."""
    producers = [await start_producer(dsn, aggregate, n, *extra) for n in range(PRODUCERS)]
    for process in producers:
        process.stdin.write(b"go\n")
        await process.stdin.drain()
    outputs = await asyncio.gather(
        *(asyncio.wait_for(p.communicate(), timeout=120) for p in producers)
    )
    for process in producers:
        assert process.returncode == 0
    return [json.loads(line) for out, _ in outputs for line in out.splitlines()]


def commit_order_violations(transactions: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """Pairs (earlier, later) where ``earlier``'s COMMIT returned before ``later``'s was sent,
    and yet ``later`` holds an id below one of ``earlier``'s."""
    by_end = sorted(transactions, key=lambda t: t["ended"])
    ends = [t["ended"] for t in by_end]
    highest: list[int] = []  # the highest id among the transactions that ended so far
    for t in by_end:
        highest.append(max([max(t["ids"]), *highest[-1:]]))
    violations = []
    for later in transactions:
        before = bisect.bisect_left(ends, later["started"])
        if before and highest[before - 1] > min(later["ids"]):
            earlier = next(t for t in by_end[:before] if max(t["ids"]) > min(later["ids"]))
            violations.append((earlier, later))
    return violations


@pytest.mark.slow
async def test_producers_of_one_aggregate_commit_and_publish_in_id_order(
    dsn: str, redis_url: str
) -> None:
    aggregate, key = fresh("hot-"), fresh("pgonce-test-")
    relays = [
        Relay(dsn, RedisStreamsPublisher(redis_url, routing=lambda m: key), batch_size=5)
        for _ in range(2)
    ]
    done = asyncio.Event()

    async def relay_while_producing(relay: Relay) -> None:
        while not done.is_set():
            await relay.drain()
            await asyncio.sleep(0.001)

    try:
        relaying = [asyncio.create_task(relay_while_producing(r)) for r in relays]
        transactions = await produce(dsn, aggregate)
        done.set()
        await asyncio.gather(*relaying)
        await relays[0].drain()
        received = await redis_read(redis_url, key)
    finally:
        for relay in relays:
            await relay.publisher.close()
        await redis_delete(redis_url, key)
    ids = sorted(i for t in transactions for i in t["ids"])
    assert len(transactions) == PRODUCERS * TRANSACTIONS
    # Each transaction's ids are its own, contiguous in the aggregate's order.
    assert len(set(ids)) == len(ids) == PRODUCERS * (TRANSACTIONS + 2 * (TRANSACTIONS // 3))
    assert commit_order_violations(transactions) == []
    # Published exactly once each, in id order (the relays ran while the producers committed).
    published = [int(r.message_id) for r in received]
    assert published == ids


def test_the_check_sees_commits_out_of_id_order() -> None:
    """The commit-order check is not vacuous: ids 1 then 2, but 2 committed before 1 began."""
    assert commit_order_violations(
        [{"ids": [1], "started": 50, "ended": 60}, {"ids": [2], "started": 10, "ended": 20}]
    ) == [({"ids": [2], "started": 10, "ended": 20}, {"ids": [1], "started": 50, "ended": 60})]
    assert (
        commit_order_violations(
            [{"ids": [1], "started": 10, "ended": 20}, {"ids": [2], "started": 15, "ended": 30}]
        )
        == []
    )
