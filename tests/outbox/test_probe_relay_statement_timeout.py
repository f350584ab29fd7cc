"""A relay whose batches a server-set statement_timeout cuts (``ALTER DATABASE ... SET
statement_timeout``) says so, once per run of failures: the statement was cut by the setting,
where it is likely set, and that the batch is retried with its rows pending; not that the
database is away ("reconnects", "answers again"), which sends the operator looking for an
outage."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from tests.cutting import claims_cut_by_statement_timeout
from tests.outbox.conftest import wait_until
from tests.outbox.stops import running


class Acking:
    name = "acking"

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        pass


async def test_a_batch_cut_by_statement_timeout_is_reported_as_such_once(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.relay")
    relay = Relay(
        direct_dsn,
        Acking(),
        concurrency=1,
        listen=False,
        poll_interval=timedelta(milliseconds=50),
        outage_backoff=(timedelta(milliseconds=20), timedelta(milliseconds=50)),
    )
    with claims_cut_by_statement_timeout(direct_dsn, "pgonce.outbox", "300ms"):
        async with running(relay) as run:
            await wait_until(lambda: relay.stats.errors >= 3, within=30)
            await run.stop_within(30, "the relay stops after its cut batches")

    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("reconnects" in m or "answers again" in m for m in loud), loud
    cut = [m for m in loud if "statement_timeout" in m]
    assert len(cut) == 1, loud
    assert "300ms" in cut[0], cut[0]
    for words in ("ALTER DATABASE", "ROLE", "retried", "pending"):
        assert words in cut[0], cut[0]
