"""pgonce reads and writes its columns with its own types, whatever the connection's adapters are.

The connection here is as hostile as an application's can be: jsonb and json come back as text
(Django registers such a loader), bytea and timestamptz as tagged strings, dicts and Json/Jsonb
are dumped by a function that wraps them, its cursor factory binds on the client and its rows are
dicts. The key store, the inbox and the outbox must store and return exactly what they were
given, through every path: claim/complete, begin/commit, once() joined and owned.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import AsyncClientCursor, ClientCursor
from psycopg.adapt import Dumper, Loader
from psycopg.rows import dict_row
from psycopg.types.json import set_json_dumps
from psycopg.types.string import TextBinaryLoader, TextLoader

from pgonce import AsyncKeyStore, KeyStore, Replay, Response, Won, fingerprint
from pgonce.core.inbox import Delivery, digest
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.outbox import OutboxStore, enqueue

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
BODY = bytes(range(256)) + b"\x00 not utf-8 \xff"
RESPONSE = Response(
    201, (("content-type", "application/octet-stream"), ("x-dup", "1"), ("x-dup", "2")), BODY
)


class Tagged(Loader):
    """Anything, read as a string that is not what pgonce stored."""

    def load(self, data: Any) -> str:
        return "tagged:" + bytes(data).hex()


class DictDumper(Dumper):
    """An application's dict dumper (orjson-like): compact JSON of a wrapped object."""

    oid = psycopg.adapters.types["jsonb"].oid

    def dump(self, obj: Any) -> bytes:
        return json.dumps({"wrapped": obj}, separators=(",", ":")).encode()


def _wrapping_dumps(obj: Any) -> str:
    return json.dumps({"wrapped": obj})


def make_hostile(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    adapters = conn.adapters
    for name in ("json", "jsonb"):
        adapters.register_loader(name, TextLoader)
        adapters.register_loader(name, TextBinaryLoader)
    for name in ("bytea", "timestamptz", "int4", "int8", "bool", "text"):
        adapters.register_loader(name, Tagged)
    adapters.register_dumper(dict, DictDumper)
    set_json_dumps(_wrapping_dumps, conn)


@pytest.fixture
def hostile(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, row_factory=dict_row, cursor_factory=ClientCursor) as conn:
        make_hostile(conn)
        yield conn


@pytest.fixture
async def ahostile(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    conn = await psycopg.AsyncConnection.connect(
        dsn, row_factory=dict_row, cursor_factory=AsyncClientCursor
    )
    async with conn:
        make_hostile(conn)
        yield conn


def test_the_connection_is_hostile(hostile: psycopg.Connection[Any]) -> None:
    row = hostile.execute("SELECT '{\"a\": 1}'::jsonb AS j, '\\x01'::bytea AS b").fetchone()
    assert row == {"j": '{"a": 1}', "b": "tagged:5c783031"}


def test_key_store_claim_complete_and_replay(
    hostile: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.claim(hostile, "s", "k", FP)
    assert isinstance(claim, Won)
    assert store.complete(hostile, claim, RESPONSE)
    hostile.commit()
    replay = store.claim(hostile, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay == Replay(RESPONSE, claim.claimed_at, replay.completed_at)
    assert replay.completed_at is not None
    assert replay.completed_at >= claim.claimed_at
    hostile.rollback()


def test_key_store_begin_commit_and_replay(
    hostile: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.begin(hostile, "s", "k", FP)
    assert isinstance(claim, Won)
    assert store.commit(hostile, claim, RESPONSE)
    replay = store.begin(hostile, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE
    with hostile.transaction():
        again = store.claim(hostile, "s", "k", FP)
    assert isinstance(again, Replay)
    assert again.response == RESPONSE


def test_once_joined_and_owned(hostile: psycopg.Connection[Any], store: KeyStore) -> None:
    with store.once(hostile, "s", "joined", FP) as op:
        op.respond(RESPONSE)
    hostile.commit()
    with store.once(hostile, "s", "owned", FP, commit=True) as op:
        op.respond(RESPONSE)
    for key in ("joined", "owned"):
        with store.once(hostile, "s", key, FP) as again:
            assert again.replayed
        assert again.response == RESPONSE
        hostile.rollback()
        with store.once(hostile, "s", key, FP, commit=True) as again:
            assert again.replayed
        assert again.response == RESPONSE


async def test_async_key_store_replays(
    ahostile: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    async with astore.once(ahostile, "s", "k", FP) as op:
        op.respond(RESPONSE)
    await ahostile.commit()
    claim = await astore.claim(ahostile, "s", "k", FP)
    assert isinstance(claim, Replay)
    assert claim.response == RESPONSE
    await ahostile.rollback()


def test_inbox_store_and_claim(hostile: psycopg.Connection[Any]) -> None:
    inbox = InboxStore()
    body = b'{"id": "evt_1", "amount": 42}'
    headers = {"content-type": "application/json", "x-signature": "v1=abc"}
    with hostile.transaction():
        assert inbox.store(hostile, [Delivery("shop", "evt_1", body, headers, digest(body))]) == [
            "stored"
        ]
    with hostile.transaction():
        [event] = inbox.claim(hostile, "shop", limit=10)
        assert (event.id, event.body, event.headers, event.attempts) == ("evt_1", body, headers, 0)
        assert event.received_at.tzinfo is not None
    with hostile.transaction():
        stored = inbox.get(hostile, "shop", "evt_1")
    assert stored is not None
    assert stored["status"] == "done"


def test_outbox_enqueue_and_claim(hostile: psycopg.Connection[Any]) -> None:
    payload = {"order": 1, "lines": [{"sku": "a", "qty": 2}]}
    with hostile.transaction():
        message_id = enqueue(hostile, "order", "1", "order.created", payload, headers={"t": "1"})
    with hostile.transaction():
        [message] = OutboxStore().claim(hostile, limit=10)
    assert (message.id, message.payload, message.headers) == (message_id, payload, {"t": "1"})


async def test_async_outbox_enqueue_and_claim(ahostile: psycopg.AsyncConnection[Any]) -> None:
    store = AsyncOutboxStore()
    async with ahostile.transaction():
        message_id = await store.enqueue(ahostile, "order", "1", "order.created", [1, {"a": None}])
    async with ahostile.transaction():
        [message] = await store.claim(ahostile, limit=10)
    assert (message.id, message.payload) == (message_id, [1, {"a": None}])
