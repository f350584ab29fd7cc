"""The receiver, the inbox worker and the inbox store on connections whose settings are not
PostgreSQL's defaults, as the key store's tests configure them
(tests/keys/test_connection_settings.py): a DateStyle other than ISO, or the client_encoding
SQL_ASCII (a SQL_ASCII database's default).
psycopg parses a timestamptz in text only in the ISO DateStyle, and loads text as bytes on
SQL_ASCII: the store reads its results in binary and its text as UTF-8, and stores, claims and
reports there as anywhere else."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgonce.core.inbox import Delivery, Ordering, digest
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SETTINGS = ["-c DateStyle=SQL,DMY", "-c DateStyle=German", "-c client_encoding=SQL_ASCII"]


@pytest.mark.parametrize("options", SETTINGS)
async def test_the_inbox_stores_and_handles_whatever_the_session_settings(
    dsn: str, options: str
) -> None:
    configured = make_conninfo(dsn, options=options)
    handled: list[Any] = []

    async def handler(event: Any, conn: psycopg.AsyncConnection[Any]) -> None:
        handled.append((event.source, event.id, event.payload))

    scheme = build_scheme("standard-webhooks", [SECRET])
    source = Source(name="shop", scheme=scheme, handler=handler)
    body = '{"type": "order.paid", "order": "o-é"}'.encode()
    async with InboxReceiver([source], dsn=configured) as receiver:
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://hooks") as client:
            headers = scheme.sign(body, event_id="m-1")
            answer = await client.post("/webhooks/shop", content=body, headers=headers)
    assert (answer.status_code, answer.json()) == (200, {"outcome": "stored"})
    async with await psycopg.AsyncConnection.connect(configured, autocommit=True) as conn:
        await InboxWorker([source], dsn=configured).run_once(conn)
    assert handled == [("shop", "m-1", {"type": "order.paid", "order": "o-é"})]


def delivery(event_id: str, body: bytes, ordering: Ordering | None = None) -> Delivery:
    return Delivery("shop", event_id, body, {"x-é": "é"}, digest(body), ordering)


@pytest.mark.parametrize("options", SETTINGS)
async def test_the_store_reads_the_same_values_whatever_the_settings(
    dsn: str, options: str
) -> None:
    store = AsyncInboxStore(schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(make_conninfo(dsn, options=options)) as conn:
        async with conn.transaction():
            outcomes = await store.store(
                conn, [delivery("é-1", b"1", Ordering("clé", 1)), delivery("é-1", b"1")]
            )
        assert outcomes == ["stored", "duplicate"]
        got = await store.get(conn, "shop", "é-1")
        assert got is not None
        assert (got["status"], got["ordering_key"], type(got["received_at"])) == (
            "pending",
            "clé",
            datetime,
        )
        assert await store.counts(conn) == {("shop", "pending"): 1}
        async with conn.transaction():
            (event,) = await store.claim(conn, "shop", limit=10)
            assert await store.claim_committed(conn, event) is True
        assert (event.source, event.id, event.ordering_key) == ("shop", "é-1", "clé")
        assert (event.headers, event.received_at) == ({"x-é": "é"}, got["received_at"])
        async with conn.transaction():
            assert await store.advance_watermark(conn, event) is True
        after = await store.get(conn, "shop", "é-1")
        assert after is not None
        assert (after["status"], type(after["processed_at"])) == ("done", datetime)


@pytest.mark.parametrize("options", SETTINGS)
def test_the_sync_store_stores_and_claims_whatever_the_settings(dsn: str, options: str) -> None:
    store = InboxStore(schema=SCHEMA)
    with psycopg.connect(make_conninfo(dsn, options=options)) as conn:
        with conn.transaction():
            assert store.store(conn, [delivery("é-2", b"2")]) == ["stored"]
        with conn.transaction():
            (event,) = store.claim(conn, "shop", limit=10)
        got = store.get(conn, "shop", "é-2")
    assert got is not None
    assert (event.id, got["status"]) == ("é-2", "done")
    assert got["processed_at"] >= event.received_at
