"""A relay whose LISTEN goes through PgBouncer in transaction mode checks, at start, whether a
notification reaches it (up to LISTEN_CHECK, 5 s, since through that pooler none does). A stop
requested during that check ends the check at once rather than wait it out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce import relay as relay_module
from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from tests.pgbouncer import listen_check_started


class Acking:
    name = "acking"

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        pass


async def test_a_stop_during_the_relays_listen_check_is_prompt(
    direct_dsn: str, pgbouncer_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled = make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])
    checking = listen_check_started(monkeypatch, relay_module)
    relay = Relay(pooled, Acking(), concurrency=1, poll_interval=timedelta(milliseconds=100))
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(checking.wait(), 30)
    stop.set()
    started = time.perf_counter()
    await asyncio.wait_for(running, 30)
    took = time.perf_counter() - started
    assert took < 1.5, f"the stop waited {took:.1f} s for the LISTEN check"
