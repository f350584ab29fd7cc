"""The relay on connections whose settings are not PostgreSQL's defaults, as the key store's tests
configure them (tests/keys/test_connection_settings.py): a DateStyle other than ISO, or the
client_encoding SQL_ASCII (a SQL_ASCII database's default). psycopg parses a timestamptz in text
only in the ISO DateStyle, and loads text as bytes on SQL_ASCII: the relay's claim, counts() and
backlog() read their results in binary and their text as UTF-8, and publish, count and check for a
pooler there as anywhere else."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from redis.asyncio import Redis

from pgonce import enqueue
from pgonce.database import _listens_on, own_prepare_threshold
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._sync.outbox import OutboxStore

SCHEMA = "pgonce"
SETTINGS = ["-c DateStyle=SQL,DMY", "-c DateStyle=German", "-c client_encoding=SQL_ASCII"]


@pytest.mark.parametrize("options", SETTINGS)
async def test_the_relay_publishes_whatever_the_session_settings(
    dsn: str, redis_url: str, options: str
) -> None:
    configured = make_conninfo(dsn, options=options)
    kind = f"order-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(configured, autocommit=True) as conn, conn.transaction():
        enqueue(conn, kind, "42", "order.created", {"id": 42, "name": "café"})
    stats = await Relay(configured, RedisStreamsPublisher(redis_url), listen=False).drain()
    redis = Redis.from_url(redis_url)
    try:
        entries = await redis.xrange(f"outbox.{kind}")
        await redis.delete(f"outbox.{kind}")
    finally:
        await redis.aclose()
    assert entries is not None
    assert (stats.published, stats.errors, len(entries)) == (1, 0, 1), stats.last_error


@pytest.mark.parametrize("options", SETTINGS)
async def test_the_claim_counts_and_backlog_read_the_same_values_whatever_the_settings(
    dsn: str, options: str
) -> None:
    store = AsyncOutboxStore(schema=SCHEMA)
    configured = make_conninfo(dsn, options=options)
    async with await psycopg.AsyncConnection.connect(configured) as conn:
        async with conn.transaction():
            await store.enqueue(
                conn, "order", "café", "order.créé", {"name": "café"}, headers={"h": "é"}
            )
        counts = await store.counts(conn)
        backlog = await store.backlog(conn)
        async with conn.transaction():
            (message,) = await store.claim(conn, limit=10)
    assert (counts.pending, counts.published, backlog.pending) == (1, 0, 1)
    assert isinstance(counts.oldest_pending, datetime)
    assert counts.oldest_pending == backlog.oldest_pending == message.created_at
    assert (message.aggregatetype, message.aggregateid, message.type) == (
        "order",
        "café",
        "order.créé",
    )
    assert (message.payload_json, message.headers) == ('{"name": "café"}', {"h": "é"})


@pytest.mark.parametrize("options", SETTINGS)
def test_the_sync_store_claims_and_counts_whatever_the_settings(dsn: str, options: str) -> None:
    store = OutboxStore(schema=SCHEMA)
    with psycopg.connect(make_conninfo(dsn, options=options)) as conn:
        with conn.transaction():
            store.enqueue(conn, "order", "é", "order.created", {"id": 1})
        counts = store.counts(conn)
        with conn.transaction():
            (message,) = store.claim(conn, limit=10)
    assert (message.aggregateid, counts.oldest_pending) == ("é", message.created_at)


async def test_no_pooler_is_reported_on_a_direct_sql_ascii_connection(
    direct_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHOW port answers text, which psycopg loads as bytes on SQL_ASCII: b'5432' is still the
    port that the connection reached, not a pooler's."""
    monkeypatch.delenv("PGONCE_POOLER", raising=False)
    caplog.set_level(logging.WARNING, logger="pgonce")
    configured = make_conninfo(direct_dsn, options="-c client_encoding=SQL_ASCII")
    async with await psycopg.AsyncConnection.connect(configured, autocommit=True) as conn:
        default = conn.prepare_threshold
        threshold = await own_prepare_threshold(conn, f"relay-{uuid.uuid4().hex[:8]}")
    assert (threshold, default) == (5, 5)
    assert [r.getMessage() for r in caplog.records if "through a pooler" in r.getMessage()] == []


def test_a_port_that_psycopg_loaded_as_bytes_is_compared_as_text(direct_dsn: str) -> None:
    configured = make_conninfo(direct_dsn, options="-c client_encoding=SQL_ASCII")
    with psycopg.connect(configured, autocommit=True) as conn:
        row = conn.execute("SHOW port").fetchone()
        assert row is not None
        assert type(row[0]) is bytes  # psycopg's own text loader
        assert _listens_on(row, conn)
        assert not _listens_on((b"1",), conn)
        assert not _listens_on(None, conn)
