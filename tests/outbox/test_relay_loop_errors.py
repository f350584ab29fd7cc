"""A relay loop that fails at every batch: each failure counted, reported once (then throttled)
with what happens next, and the rows left pending."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import ConfigError
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import free_port, wait_until


class Broken:
    """A publisher with a bug: every publish raises."""

    name = "broken"

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        raise RuntimeError("the publisher has a bug")

    async def close(self) -> None:
        pass


async def test_a_failing_batch_is_counted_every_time_and_logged_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(dsn) as conn:
        enqueue(conn, "order", "1", "e", {})
        conn.commit()
    relay = Relay(
        dsn,
        Broken(),
        listen=False,
        outage_backoff=(timedelta(milliseconds=1), timedelta(milliseconds=5)),
    )
    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="pgonce.relay"):
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: relay.stats.errors >= 8)
        finally:
            stop.set()
            await running
    reports = [r for r in caplog.records if "a batch failed" in r.getMessage()]
    assert len(reports) == 1
    assert "rows were not marked and wait" in reports[0].getMessage()
    assert "tries again in" in reports[0].getMessage()
    assert reports[0].exc_info is not None
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pgonce.outbox WHERE published_at IS NULL"
        ).fetchone() == (1,)


@pytest.mark.parametrize(
    "options",
    [
        {"dsn": "postgres//relay:s3cret@127.0.0.1/db"},
        {"dsn": "postgresql://127.0.0.1/db", "listen_dsn": "postgres//relay:s3cret@127.0.0.1/db"},
    ],
)
def test_a_connection_string_libpq_cannot_read_is_refused_without_its_password(
    options: dict[str, str],
) -> None:
    # libpq's own message quotes the text, password included, and the loop would log it.
    dsn = options.pop("dsn")
    with pytest.raises(ConfigError, match="not repeated here") as raised:
        Relay(dsn, Broken(), **options)  # type: ignore[arg-type]
    assert "s3cret" not in str(raised.value)
    assert raised.value.__suppress_context__


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"batch_size": 1.5}, "batch_size must be a whole number"),
        ({"batch_size": "100"}, "batch_size must be a whole number"),
        ({"per_aggregate": 0}, "per_aggregate must be a whole number"),
        ({"concurrency": True}, "concurrency must be a whole number"),
        ({"poll_interval": 5}, "poll_interval"),
        ({"outage_backoff": (timedelta(0), timedelta(seconds=1))}, "outage_backoff"),
    ],
)
def test_relay_settings_that_would_fail_every_batch_are_config_errors(
    options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        Relay("postgresql://127.0.0.1/db", Broken(), **options)


async def test_a_listen_connection_that_keeps_failing_is_reported_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/db"

    class Counting(Relay):
        attempts = 0

        async def connect(self, dsn: str) -> Any:
            if dsn == nowhere:
                Counting.attempts += 1
            return await super().connect(dsn)

    relay = Counting(dsn, Broken(), listen_dsn=nowhere, poll_interval=timedelta(milliseconds=20))
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="pgonce.relay"):
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: Counting.attempts >= 5)
        finally:
            stop.set()
            await running
    reports = [r.getMessage() for r in caplog.records if "LISTEN connection lost" in r.getMessage()]
    assert len(reports) == 1
    assert "polling every 0.02 s meanwhile" in reports[0]
