"""Misuse is refused at the call with one clear line, not later at the commit as psycopg's error.

Each test gives what a new user plausibly gives (a str body, a dict of headers, a sync connection
to an async store, ...) and asserts the useful part of the message: what was given and what to do.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import errors
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Response
from pgonce.errors import NotInTransaction, UsageError
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._async.outbox import enqueue as aenqueue
from pgonce.store._async.phases import AsyncPhaseStore
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.keys import KeyStore
from pgonce.store._sync.outbox import OutboxStore, enqueue
from pgonce.store._sync.phases import PhaseStore

FP = fingerprint("POST", "/orders", b"{}")


def test_a_str_body_is_refused_at_construction_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"body must be bytes, not str: encode it"):
        Response(201, body="created")  # type: ignore[arg-type]


def test_headers_given_as_a_dict_are_taken_as_their_items() -> None:
    response = Response(200, {"content-type": "application/json"})  # type: ignore[arg-type]
    assert response.headers == (("content-type", "application/json"),)
    assert response == Response(200, [("content-type", "application/json")])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"retry-after": 5}, r"pairs of str; got \(str, int\)"),
        ([("x-one",)], r"pairs of str; got \(str\)"),
        ("content-type: text/plain", r"sequence of \(name, value\) pairs of str, not str"),
        (42, r"not int"),
        ((("x-token", "s3cr\udc80t"),), r"the 'x-token' header's value holds a lone surrogate"),
        ([("x-\ud800", "v")], r"a header's name holds a lone surrogate at position 2"),
    ],
)
def test_malformed_headers_are_refused_at_construction(headers: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Response(200, headers)


def test_a_refused_header_value_is_not_echoed() -> None:
    with pytest.raises(UsageError) as refused:
        Response(200, (("authorization", "Bearer t0ken\udc80"),))
    assert "t0ken" not in str(refused.value)


def test_non_ascii_headers_are_kept_and_replayed_as_they_are() -> None:
    headers = (
        ("content-disposition", 'attachment; filename="r\u00e9sum\u00e9.pdf"'),
        ("x-e", "\U0001f600"),
    )
    assert Response(200, headers).headers == headers
    assert Response.from_stored(200, [list(h) for h in headers], b"").headers == headers
    assert Response.from_stored(200, headers, b"").headers == headers


def test_a_status_that_is_not_an_int_is_refused() -> None:
    with pytest.raises(UsageError, match="status must be an int or None, not str"):
        Response("201")  # type: ignore[arg-type]


def test_a_bytearray_body_is_kept_as_bytes() -> None:
    assert Response(200, body=bytearray(b"ok")).body == b"ok"  # type: ignore[arg-type]


def test_every_default_message_is_one_line_without_markup() -> None:
    for name in dir(errors):
        kind = getattr(errors, name)
        if not (isinstance(kind, type) and issubclass(kind, errors.PgonceError)):
            continue
        try:
            message = str(kind())
        except TypeError:
            continue  # needs arguments: its message is written by its constructor
        assert "\n" not in message, name
        assert "``" not in message, name
    assert str(NotInTransaction()) == (
        "The connection is in autocommit mode outside a transaction, where this write would "
        "commit alone: open a transaction first (with conn.transaction(): ...)."
    )


def test_store_constructors_check_their_arguments() -> None:
    with pytest.raises(UsageError, match=r"wait must be a datetime\.timedelta, not an int"):
        KeyStore(wait=2)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="retry_after must be a whole number of at least 0"):
        AsyncKeyStore(retry_after="1")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="store_server_errors must be True or False"):
        KeyStore(store_server_errors="yes")  # type: ignore[arg-type]
    for store in (KeyStore, AsyncInboxStore, OutboxStore):
        with pytest.raises(UsageError, match="the schema must be a str, not an int"):
            store(schema=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "settings",
    [
        {"schema": ""},
        {"wait": 2},
        {"wait": timedelta(milliseconds=5)},
        {"wait": timedelta(days=100_000)},
        {"retry_after": -1},
        {"store_server_errors": "yes"},
    ],
    ids=["schema", "wait-type", "wait-short", "wait-long", "retry_after", "store_server_errors"],
)
def test_the_two_phase_stores_refuse_the_key_stores_settings_alike(settings: Any) -> None:
    # One check serves every store of keys: the same value is refused with the same message.
    with pytest.raises(UsageError) as refused:
        KeyStore(**settings)
    for store in (PhaseStore, AsyncPhaseStore, AsyncKeyStore):
        with pytest.raises(UsageError) as also:
            store(**settings)
        assert str(also.value) == str(refused.value)


async def test_an_async_store_names_a_sync_connection(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(
        UsageError,
        match=r"AsyncKeyStore needs an async psycopg connection \(AsyncConnection\), and was "
        r"given a sync one: use KeyStore with it",
    ):
        await AsyncKeyStore().claim(conn, "scope", "key", FP)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="AsyncOutboxStore needs an async psycopg connection"):
        await AsyncOutboxStore().claim(conn, limit=1)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="AsyncInboxStore needs an async psycopg connection"):
        await AsyncInboxStore().claim(conn, "shop", limit=1)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"enqueue\(\) needs an async psycopg connection"):
        await aenqueue(conn, "order", "1", "created", {})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="use KeyStore with it"):
        AsyncKeyStore().once(conn, "scope", "key", FP)  # type: ignore[arg-type]


async def test_a_sync_store_names_an_async_connection(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    with pytest.raises(
        UsageError,
        match=r"KeyStore needs a sync psycopg connection \(Connection\), and was given an "
        r"async one: use AsyncKeyStore with it",
    ):
        KeyStore().claim(aconn, "scope", "key", FP)  # type: ignore[arg-type]
    with pytest.raises(
        UsageError, match=r"enqueue\(\) needs a sync .* use the async enqueue\(\) with it"
    ):
        enqueue(aconn, "order", "1", "created", {})  # type: ignore[arg-type]


def test_a_pool_or_cursor_is_named_with_the_fix(conn: psycopg.Connection[Any]) -> None:
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool("", open=False)
    with pytest.raises(UsageError, match=r"not a psycopg_pool ConnectionPool: take one from"):
        KeyStore().claim(pool, "scope", "key", FP)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"not a psycopg Cursor: pass the cursor's connection"):
        KeyStore().claim(conn.cursor(), "scope", "key", FP)  # type: ignore[arg-type]


def test_completing_with_the_wrong_things_is_refused_before_any_write(
    conn: psycopg.Connection[Any],
) -> None:
    store = KeyStore()
    claim = store.claim(conn, "scope", "key", FP)
    with pytest.raises(UsageError, match=r"response must be a pgonce Response or None, not tuple"):
        store.complete(conn, claim, (201, [], b""))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"a won claim .* is expected, not str"):
        store.complete(conn, "scope/key", Response(201))  # type: ignore[arg-type]
    assert store.complete(conn, claim, Response(201, {"a": "b"}, b"x"))  # type: ignore[arg-type]
    conn.commit()
    replay = store.claim(conn, "scope", "key", FP)
    assert getattr(replay, "response", None) == Response(201, (("a", "b"),), b"x")


def test_outbox_and_inbox_arguments_are_checked(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(
        UsageError, match="outbox headers must be a mapping of str to str, not list"
    ):
        enqueue(conn, "order", "1", "created", {}, headers=[("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="the aggregateid must be a str, not int"):
        enqueue(conn, "order", 1, "created", {})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="a batch's limit must be a whole number of at least 1"):
        OutboxStore().claim(conn, limit=0)
    with pytest.raises(
        UsageError, match=r"the ids must be a sequence of whole numbers, not an int"
    ):
        OutboxStore().replay(conn, ids=5)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"event_ids must be a sequence of str.*\(for one, pass"):
        InboxStore().replay(conn, "shop", "evt_1")
    with pytest.raises(UsageError, match="the claim limit must be a whole number of at least 1"):
        InboxStore().claim(conn, "shop", limit="10")  # type: ignore[arg-type]
    now = datetime.now(UTC) - timedelta(0)
    assert OutboxStore().claim(conn, limit=1, now=now) == []
