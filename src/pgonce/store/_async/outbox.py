"""The outbox on an async psycopg connection: enqueue in the caller's transaction, and the relay's
claim, mark and refusal statements.

:func:`enqueue` runs on the caller's connection inside the caller's transaction, so an event exists
exactly when the business write it describes committed. The relay's statements run inside the
relay's own transaction: a batch is locked by :meth:`AsyncOutboxStore.claim` and marked in the same
transaction after the broker answered, so a relay that dies in between releases its rows to the
next relay (a redelivery with the same message id, never a loss). This file is the source of
``_sync/outbox.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

from psycopg import AsyncConnection

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.channels import notify_channel
from pgonce.core.checks import (
    check_bool,
    check_connection,
    check_ids,
    check_instance,
    check_int,
    check_optional_time,
    check_str,
)
from pgonce.core.outbox import (
    EventRow,
    OutboxBacklog,
    OutboxCounts,
    OutboxEvent,
    OutboxMessage,
    Refusal,
    check_jsonb,
    event_headers,
    event_row,
    not_json,
    type_name,
    validate_event,
)
from pgonce.errors import UsageError
from pgonce.sql import Queries, positional
from pgonce.store._async.counts import changed
from pgonce.store._async.notify import listen
from pgonce.store.common import check_schema, require_transaction
from pgonce.store.cursors import cursor, raw_cursor
from pgonce.store.errors import translate_caller_errors, translate_errors

Row = TypeVar("Row")


async def enqueue(
    conn: AsyncConnection[Row],
    aggregatetype: str,
    aggregateid: str,
    type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    schema: str = DEFAULT_SCHEMA,
    now: datetime | None = None,
    ordered: bool = True,
) -> int:
    """Write an event in the connection's current transaction; return its id (the message id).

    ``payload`` is anything JSON can encode. It commits or rolls back with the caller's writes;
    an autocommit connection outside a transaction raises
    :class:`~pgonce.errors.NotInTransaction`. Events of one aggregate are serialized: a second
    transaction enqueueing for the same aggregate waits here until the first one ends, so that
    the id order of an aggregate's events is their commit order. ``ordered=False`` skips that
    wait (and the aggregate's lock row) for events whose order does not matter: concurrent
    transactions may then commit them in another order than their ids.
    """
    if not isinstance(conn, AsyncConnection):
        check_connection(conn, AsyncConnection, "enqueue()")
    row = event_row(aggregatetype, aggregateid, type, payload, headers, now, ordered)
    return await enqueue_row(conn, row, schema=schema, ordered=ordered)


async def enqueue_row(
    conn: AsyncConnection[Row],
    row: EventRow,
    *,
    schema: str = DEFAULT_SCHEMA,
    ordered: bool = True,
) -> int:
    """Write ``row``, an event's checked arguments (:func:`~pgonce.core.outbox.event_row`), in
    the connection's current transaction; its id. :func:`enqueue` once the arguments are
    checked, for an adapter that has the connection of its framework's transaction."""
    require_transaction(conn)
    statement, channel = _enqueue_statement(schema, ordered)
    with translate_caller_errors("enqueueing an outbox event"):
        cur = raw_cursor(conn)
        await cur.execute(statement, (*row, channel))
        written = await cur.fetchone()
    assert written is not None, "the enqueue statement returned no row"
    return int(written[0])


# enqueue()'s parameters, in the order of its statements' $n (both statements take them all).
_ENQUEUE_PARAMS = ("aggregatetype", "aggregateid", "type", "payload", "headers", "now", "channel")


@cache
def _enqueue_statement(schema: str, ordered: bool) -> tuple[bytes, str]:
    """enqueue()'s statement with $n placeholders (see raw_cursor()), and the channel it
    notifies: made once per schema, so that an enqueue looks up one cache, not three."""
    queries = Queries("outbox", schema)
    text = queries.enqueue if ordered else queries.enqueue_unordered
    return positional(text, _ENQUEUE_PARAMS), notify_channel(schema, "outbox")


async def enqueue_many(
    conn: AsyncConnection[Row],
    events: Iterable[OutboxEvent | tuple[Any, ...]],
    *,
    schema: str = DEFAULT_SCHEMA,
    now: datetime | None = None,
    ordered: bool = True,
) -> list[int]:
    """Write several events in one statement, in the connection's current transaction; return
    their ids, one per event in the order given (ascending).

    Each event is an :class:`~pgonce.core.outbox.OutboxEvent` or a tuple of its fields
    (aggregatetype, aggregateid, type, payload[, headers]). The events of one aggregate are
    published in the order given; ``ordered`` is :func:`enqueue`'s. No events: no statement,
    ``[]``.
    """
    check_connection(conn, AsyncConnection, "enqueue_many()")
    check_bool(ordered, "ordered")
    check_optional_time(now)
    batch = _events(events)
    require_transaction(conn)
    if not batch:
        return []
    with _json_refused():
        payloads = json.dumps([e.payload for e in batch], allow_nan=False)
    headers = json.dumps([event_headers(e.headers) for e in batch])
    check_jsonb(payloads, headers)
    params = {
        "aggregatetypes": [e.aggregatetype for e in batch],
        "aggregateids": [e.aggregateid for e in batch],
        "types": [e.type for e in batch],
        # One JSON document each for payloads and headers: one dump, not one per event.
        "payloads": payloads,
        "headers": headers,
        "now": now,
        "channel": notify_channel(schema, "outbox"),
    }
    queries = Queries("outbox", schema)
    statement = queries.enqueue_many if ordered else queries.enqueue_many_unordered
    with translate_caller_errors("enqueueing outbox events"):
        cur = cursor(conn)
        await cur.execute(statement, params)
        rows = await cur.fetchall()
    assert len(rows) == len(batch), "the enqueue_many statement lost an event"
    # The ids were allocated in the given order.
    return sorted(int(r[0]) for r in rows)


@contextmanager
def _json_refused() -> Iterator[None]:
    """What json.dumps refuses is the caller's input, said as such (nothing was written)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise not_json(exc) from exc


def _events(events: object) -> list[OutboxEvent]:
    if isinstance(events, str | bytes | Mapping) or not isinstance(events, Iterable):
        raise UsageError(
            f"enqueue_many() takes a sequence of OutboxEvent, not {type_name(events)}: pass "
            "[OutboxEvent('order', '42', 'order.created', {...}), ...]"
        )
    batch = []
    for number, item in enumerate(events):
        if isinstance(item, OutboxEvent):
            event = item
        elif isinstance(item, tuple) and 4 <= len(item) <= 5:
            event = OutboxEvent(*item)
        else:
            raise UsageError(
                f"event {number} must be an OutboxEvent (aggregatetype, aggregateid, type, "
                f"payload[, headers]), not {type_name(item)}"
                + (f" of {len(item)} fields" if isinstance(item, tuple) else "")
            )
        validate_event(event.aggregatetype, event.aggregateid, event.type)
        batch.append(event)
    return batch


class AsyncOutboxStore:
    """The relay's statements on the ``outbox`` table; each runs in the caller's transaction."""

    def __init__(self, *, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = check_schema(schema)
        self.channel = notify_channel(schema, "outbox")
        self._sql = Queries("outbox", schema)

    async def enqueue(
        self,
        conn: AsyncConnection[Row],
        aggregatetype: str,
        aggregateid: str,
        type: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        now: datetime | None = None,
        ordered: bool = True,
    ) -> int:
        """:func:`enqueue` in this store's schema."""
        return await enqueue(
            conn,
            aggregatetype,
            aggregateid,
            type,
            payload,
            headers=headers,
            schema=self.schema,
            now=now,
            ordered=ordered,
        )

    async def enqueue_many(
        self,
        conn: AsyncConnection[Row],
        events: Iterable[OutboxEvent | tuple[Any, ...]],
        *,
        now: datetime | None = None,
        ordered: bool = True,
    ) -> list[int]:
        """:func:`enqueue_many` in this store's schema."""
        return await enqueue_many(conn, events, schema=self.schema, now=now, ordered=ordered)

    async def claim(
        self,
        conn: AsyncConnection[Row],
        *,
        limit: int,
        per_aggregate: int | None = None,
        now: datetime | None = None,
    ) -> list[OutboxMessage]:
        """Take up to ``limit`` due rows (at most ``per_aggregate`` of one aggregate) for this
        transaction, in id order.

        Only an aggregate whose oldest pending row is due and not locked by another relay takes
        part, with its following rows up to the first that another relay holds; every row
        returned stays locked until the transaction ends. So no row goes to two relays, and no
        relay takes a row of an aggregate after one that another relay holds.
        """
        check_connection(conn, AsyncConnection, self)
        per_aggregate = limit if per_aggregate is None else per_aggregate
        check_int(limit, "a batch's limit")
        check_int(per_aggregate, "per_aggregate")
        require_transaction(conn)
        params = {"limit": limit, "per_aggregate": per_aggregate, "now": now}
        with translate_errors("claiming outbox rows"):
            cur = cursor(conn)
            # Binary results, here and wherever a statement returns a timestamp: psycopg parses
            # a timestamptz in text only in the ISO DateStyle (and binary is the cheaper load).
            await cur.execute(self._sql.claim, params, binary=True)
            rows = await cur.fetchall()
        return [OutboxMessage(r[0], r[1], r[2], r[3], r[4], r[5] or {}, r[6], r[7]) for r in rows]

    async def mark_published(
        self, conn: AsyncConnection[Row], ids: Sequence[int], *, now: datetime | None = None
    ) -> int:
        """Mark rows the broker acknowledged; returns how many changed."""
        check_connection(conn, AsyncConnection, self)
        ids = check_ids(ids, "the ids")
        if not ids:
            return 0
        require_transaction(conn)
        # The ids travel as one array literal: psycopg's list adapter dumps each element on its
        # own, a tenth of the relay's own CPU per event.
        params = {"ids": "{" + ",".join(map(str, ids)) + "}", "now": now}
        with translate_errors("marking outbox rows published"):
            cur = await cursor(conn).execute(self._sql.mark_published, params)
            return await changed(conn, cur)

    async def record_refusals(self, conn: AsyncConnection[Row], refusals: Sequence[Refusal]) -> int:
        """Write the core's decisions for refused rows (next attempt, or parked)."""
        check_connection(conn, AsyncConnection, self)
        for refusal in refusals:
            check_instance(refusal, Refusal, "each refusal", "core.outbox.refuse() makes them")
        if not refusals:
            return 0
        require_transaction(conn)
        params = {
            "ids": [r.id for r in refusals],
            "attempts": [r.attempts for r in refusals],
            "next_attempt_at": [r.next_attempt_at for r in refusals],
            "parked_at": [r.parked_at for r in refusals],
            "last_error": [r.last_error for r in refusals],
        }
        with translate_errors("recording outbox refusals"):
            cur = await cursor(conn).execute(self._sql.record_refusals, params)
            return await changed(conn, cur)

    async def replay(
        self,
        conn: AsyncConnection[Row],
        *,
        ids: Sequence[int] | None = None,
        aggregatetype: str | None = None,
        now: datetime | None = None,
    ) -> list[int]:
        """Put parked rows back in the queue (all of them, or those ``ids``, or one aggregate type).

        The rows are due at once with their attempts reset, and the relays are woken when the
        transaction commits. Returns the ids replayed. It waits for a relay that is publishing
        rows of their aggregates, and holds those aggregates' ordered producers until the
        transaction ends: commit it soon.
        """
        check_connection(conn, AsyncConnection, self)
        require_transaction(conn)
        if ids is not None:
            ids = check_ids(ids, "the ids")
        if aggregatetype is not None:
            check_str(aggregatetype, "the aggregatetype")
        params = {
            "ids": list(ids) if ids is not None else None,
            "aggregatetype": aggregatetype,
            "now": now,
        }
        with translate_errors("replaying parked outbox rows"):
            # Two statements first, each with its own snapshot: the aggregates' lock rows (no
            # ordered producer of theirs commits meanwhile), then their pending rows (waits for
            # a relay publishing some of them): a replayed row is its aggregate's oldest pending
            # row, which must not appear behind a relay's back (see the claim statement).
            await cursor(conn).execute(self._sql.replay_hold, params)
            await cursor(conn).execute(self._sql.replay_wait, params)
            cur = cursor(conn)
            await cur.execute(self._sql.replay, params)
            replayed = [int(r[0]) for r in await cur.fetchall()]
            if replayed:
                await cursor(conn).execute(self._sql.notify, {"channel": self.channel})
        return replayed

    async def set_waiting(self, conn: AsyncConnection[Row], relay: str, waiting: bool) -> None:
        """Register (or unregister) ``relay`` as waiting for notifications; enqueue() sends NOTIFY
        only while some relay is registered (NOTIFY serializes commits). Runs as its own
        statement: call it on the relay's connection outside a batch."""
        check_connection(conn, AsyncConnection, self)
        statement = self._sql.register_waiting if waiting else self._sql.unregister_waiting
        with translate_errors("registering a waiting relay"):
            await cursor(conn).execute(statement, {"relay": relay})

    async def listen(self, conn: AsyncConnection[Row]) -> None:
        """Subscribe ``conn`` to the outbox channel (see :mod:`.notify`)."""
        check_connection(conn, AsyncConnection, self)
        await listen(conn, self.channel, "outbox")

    async def counts(
        self, conn: AsyncConnection[Row], *, now: datetime | None = None
    ) -> OutboxCounts:
        """Pending, waiting, parked and published rows (a full scan: for people and tests)."""
        row = await self._one_row(conn, self._sql.counts, now)
        return OutboxCounts(
            pending=int(row[0]),
            waiting=int(row[1]),
            parked=int(row[2]),
            published=int(row[3]),
            oldest_pending=row[4],
        )

    async def backlog(
        self, conn: AsyncConnection[Row], *, now: datetime | None = None
    ) -> OutboxBacklog:
        """Pending, waiting and parked rows from the partial indexes (for metrics: any size)."""
        row = await self._one_row(conn, self._sql.backlog, now)
        return OutboxBacklog(int(row[0]), int(row[1]), int(row[2]), row[3])

    async def _one_row(
        self, conn: AsyncConnection[Row], statement: bytes, now: datetime | None
    ) -> tuple[Any, ...]:
        check_connection(conn, AsyncConnection, self)
        with translate_errors("counting outbox rows"):
            cur = cursor(conn)
            await cur.execute(statement, {"now": now}, binary=True)
            row = await cur.fetchone()
        assert row is not None
        return row
