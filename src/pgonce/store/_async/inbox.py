"""The webhook inbox on an async psycopg connection.

Every call runs on the caller's connection and in the caller's transaction: a batch of deliveries
is stored (and the workers notified) when that transaction commits; a worker's claim, its handlers'
writes and the events' new status commit together. This file is the source of ``_sync/inbox.py``
(``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.channels import notify_channel
from pgonce.core.checks import (
    check_connection,
    check_instance,
    check_int,
    check_optional_time,
    check_str,
    check_strs,
    describe,
    storable_text,
)
from pgonce.core.inbox import (
    DeadLetter,
    Delivery,
    InboxEvent,
    Ordering,
    Retry,
    StoreOutcome,
)
from pgonce.errors import UsageError
from pgonce.sql import Queries
from pgonce.store._async.counts import changed
from pgonce.store._async.notify import listen
from pgonce.store.common import check_schema, require_transaction
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")

_OUTCOMES: frozenset[str] = frozenset({"stored", "duplicate", "conflict", "gone"})


class AsyncInboxStore:
    """Stores, claims, completions, failures and replays of events in pgonce's ``inbox`` table."""

    def __init__(self, *, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = check_schema(schema)
        #: The LISTEN/NOTIFY channel: one notification per stored batch wakes the workers.
        self.channel = notify_channel(schema, "inbox")
        self._sql = Queries("inbox", schema)

    async def store(
        self,
        conn: AsyncConnection[Row],
        deliveries: Sequence[Delivery],
        *,
        now: datetime | None = None,
    ) -> list[StoreOutcome]:
        """Store ``deliveries`` in the current transaction; one outcome per delivery, in order.

        One statement for the whole batch: ``"stored"`` (new, commits with the transaction),
        ``"duplicate"`` (same id, same body), ``"conflict"`` (same id, another body) or ``"gone"``
        (the stored row vanished while being read: retry). Workers are notified once, at commit,
        when anything was stored.
        """
        check_connection(conn, AsyncConnection, self)
        require_transaction(conn)
        if not isinstance(deliveries, list | tuple):
            raise UsageError(
                f"the deliveries must be a list of Delivery, not {describe(deliveries)}"
            )
        for delivery in deliveries:
            _check_delivery(delivery)
        check_optional_time(now)
        if not deliveries:
            return []
        params: dict[str, Any] = {
            "sources": [d.source for d in deliveries],
            "event_ids": [d.event_id for d in deliveries],
            "bodies": [d.body for d in deliveries],
            "headers": [Jsonb(dict(d.headers)) for d in deliveries],
            "digests": [d.digest for d in deliveries],
            "ordering_keys": [d.ordering.key if d.ordering else None for d in deliveries],
            "versions": [d.ordering.version if d.ordering else None for d in deliveries],
            "now": now,
            "channel": self.channel,
        }
        with translate_errors("storing webhook deliveries"):
            cur = cursor(conn)
            # Binary results, here and wherever a statement returns a timestamp: psycopg parses a
            # timestamptz in text only in the ISO DateStyle (and binary is the cheaper load).
            await cur.execute(self._sql.store, params, binary=True)
            rows = await cur.fetchall()
        outcomes: list[StoreOutcome | None] = [None] * len(deliveries)
        for ord_, outcome in rows:
            assert outcome in _OUTCOMES, f"inbox_store() returned {outcome!r}"
            outcomes[ord_ - 1] = outcome
        assert all(o is not None for o in outcomes), "inbox_store() skipped a delivery"
        return [o for o in outcomes if o is not None]

    async def claim(
        self,
        conn: AsyncConnection[Row],
        source: str,
        *,
        limit: int,
        blocking: bool = True,
        now: datetime | None = None,
    ) -> list[InboxEvent]:
        """Lock up to ``limit`` due, pending events of ``source`` and mark them done, in the
        current transaction, which must run their handlers before it commits.

        The mark is visible to nobody until the commit, and a failed handler's event is set back
        by :meth:`fail` (or its transaction rolled back). Events with an ordering key are taken
        only at the head of their key; a dead head blocks its key when ``blocking``. Rows locked
        by other workers are skipped, not waited for. The locks last until the transaction ends:
        a crashed worker's rows are free again as soon as PostgreSQL notices the lost connection.
        """
        check_connection(conn, AsyncConnection, self)
        require_transaction(conn)
        check_str(source, "the source")
        check_int(limit, "the claim limit")
        check_optional_time(now)
        params = {"source": source, "blocking": blocking, "limit": limit, "now": now}
        with translate_errors("claiming inbox events"):
            cur = cursor(conn)
            await cur.execute(self._sql.claim, params, binary=True)
            rows = await cur.fetchall()
        # UPDATE ... RETURNING does not keep the claim's order: due first, then arrival.
        rows.sort(key=lambda row: (row[8], row[9]))
        return [
            InboxEvent(
                source=row[0],
                id=row[1],
                body=bytes(row[2]),
                headers=row[3],
                attempts=row[4],
                received_at=row[5],
                ordering_key=row[6],
                version=row[7],
            )
            for row in rows
        ]

    async def savepoint(self, conn: AsyncConnection[Row]) -> None:
        """Open the savepoint that isolates one event's handler from the rest of its batch."""
        with translate_errors("opening an inbox savepoint"):
            await cursor(conn).execute(self._sql.savepoint)

    async def release_savepoint(self, conn: AsyncConnection[Row]) -> None:
        with translate_errors("releasing an inbox savepoint"):
            await cursor(conn).execute(self._sql.release_savepoint)

    async def next_savepoint(self, conn: AsyncConnection[Row]) -> None:
        """Release the savepoint of one event and open the next one's, in one round trip."""
        with translate_errors("moving to the next inbox savepoint"):
            await cursor(conn).execute(self._sql.next_savepoint)

    async def rollback_savepoint(self, conn: AsyncConnection[Row]) -> None:
        """Undo one handler's writes (also after an error aborted the transaction)."""
        with translate_errors("rolling back an inbox savepoint"):
            await cursor(conn).execute(self._sql.rollback_savepoint)

    async def skip(self, conn: AsyncConnection[Row], event: InboxEvent) -> None:
        """Record a claimed event as ``"skipped"`` (dropped as out of order; no handler ran)."""
        check_connection(conn, AsyncConnection, self)
        _check_event(event)
        require_transaction(conn)
        with translate_errors("skipping an inbox event"):
            await cursor(conn).execute(
                self._sql.skip, {"source": event.source, "event_id": event.id}
            )

    async def fail(
        self,
        conn: AsyncConnection[Row],
        event: InboxEvent,
        decision: Retry | DeadLetter,
        error: str,
        *,
        claimed: bool = True,
        now: datetime | None = None,
    ) -> None:
        """Record a failed run of ``event``'s handler: retry at ``decision.at``, or dead-letter.

        ``claimed`` says the event was claimed in the current transaction (its row is marked
        done and locked); false after the claiming transaction rolled back.
        """
        check_connection(conn, AsyncConnection, self)
        _check_event(event)
        check_instance(
            decision, (Retry, DeadLetter), "the decision", "core.inbox.after_failure() makes it"
        )
        check_optional_time(now)
        if not isinstance(error, str):
            raise UsageError(f"the error must be a str, not {describe(error)}")
        error = storable_text(error)  # a NUL or a lone surrogate would fail the write
        require_transaction(conn)
        params = {
            "expected": "done" if claimed else "pending",
            "source": event.source,
            "event_id": event.id,
            "status": decision.status,
            "next_attempt_at": decision.at if isinstance(decision, Retry) else None,
            "error": error,
            "now": now,
        }
        with translate_errors("recording an inbox failure"):
            await cursor(conn).execute(self._sql.fail, params)

    async def claim_committed(self, conn: AsyncConnection[Row], event: InboxEvent) -> bool:
        """After a handler ended its batch's transaction (a COMMIT or ROLLBACK in SQL): whether
        that transaction committed, with the claim's done marks. ``event`` is the handler's;
        its row is locked until the current transaction ends."""
        check_connection(conn, AsyncConnection, self)
        _check_event(event)
        require_transaction(conn)
        params = {"source": event.source, "event_id": event.id}
        with translate_errors("reading an inbox event's claim"):
            cur = cursor(conn)
            await cur.execute(self._sql.claim_committed, params, binary=True)
            row = await cur.fetchone()
        return row is not None and bool(row[0])

    async def reopen(self, conn: AsyncConnection[Row], events: Sequence[InboxEvent]) -> int:
        """Set events a committed claim marked done, and whose handlers did not run, back to
        pending (no attempt counted); how many were."""
        check_connection(conn, AsyncConnection, self)
        for event in events:
            _check_event(event)
        require_transaction(conn)
        reopened = 0
        by_source: dict[str, list[str]] = {}
        for event in events:
            by_source.setdefault(event.source, []).append(event.id)
        with translate_errors("reopening inbox events"):
            for source, ids in by_source.items():
                cur = await cursor(conn).execute(
                    self._sql.reopen, {"source": source, "event_ids": ids}
                )
                reopened += await changed(conn, cur)
        return reopened

    async def advance_watermark(
        self,
        conn: AsyncConnection[Row],
        event: InboxEvent,
        *,
        now: datetime | None = None,
    ) -> bool:
        """Move the watermark of the event's ordering key to its version; False when the event is
        older than the version already applied (the out-of-order policy then skips it)."""
        check_connection(conn, AsyncConnection, self)
        _check_event(event)
        require_transaction(conn)
        if event.ordering_key is None or event.version is None:
            raise UsageError("only an event with an ordering key and a version has a watermark")
        params = {
            "source": event.source,
            "ordering_key": event.ordering_key,
            "version": event.version,
            "event_id": event.id,
            "now": now,
        }
        with translate_errors("advancing an inbox watermark"):
            cur = cursor(conn)
            await cur.execute(self._sql.advance_watermark, params)
            return await cur.fetchone() is not None

    async def replay(
        self,
        conn: AsyncConnection[Row],
        source: str,
        event_ids: Sequence[str] | None = None,
        *,
        now: datetime | None = None,
    ) -> list[str]:
        """Put dead letters of ``source`` (all, or those in ``event_ids``) back to pending with a
        fresh retry budget, in the current transaction; returns the replayed ids."""
        check_connection(conn, AsyncConnection, self)
        check_str(source, "the source")
        require_transaction(conn)
        if event_ids is not None:
            check_strs(event_ids, "event_ids")
        params = {
            "source": source,
            "event_ids": None if event_ids is None else list(event_ids),
            "now": now,
        }
        with translate_errors("replaying dead inbox events"):
            cur = cursor(conn)
            await cur.execute(self._sql.replay, params)
            replayed = [row[0] for row in await cur.fetchall()]
            if replayed:
                await cursor(conn).execute(self._sql.notify, {"channel": self.channel})
        return replayed

    async def set_waiting(self, conn: AsyncConnection[Row], worker: str, waiting: bool) -> None:
        """Register (or unregister) ``worker`` as waiting for notifications: :meth:`store` sends
        NOTIFY only while some worker is registered (NOTIFY serializes commits). Runs in the
        caller's transaction; the registration counts once committed."""
        check_connection(conn, AsyncConnection, self)
        check_str(worker, "the worker")
        statement = self._sql.register_waiting if waiting else self._sql.unregister_waiting
        with translate_errors("registering a waiting inbox worker"):
            await cursor(conn).execute(statement, {"worker": worker})

    async def listen(self, conn: AsyncConnection[Row]) -> None:
        """Subscribe ``conn`` to the inbox channel (see :mod:`.notify`)."""
        check_connection(conn, AsyncConnection, self)
        await listen(conn, self.channel, "inbox")

    async def get(
        self, conn: AsyncConnection[Row], source: str, event_id: str
    ) -> dict[str, Any] | None:
        """One event's bookkeeping (no body), for inspection and tests; None when unknown."""
        check_connection(conn, AsyncConnection, self)
        check_str(source, "the source")
        check_str(event_id, "the event id")
        with translate_errors("reading an inbox event"):
            cur = cursor(conn)
            await cur.execute(self._sql.get, {"source": source, "event_id": event_id}, binary=True)
            row = await cur.fetchone()
            names = [c.name for c in cur.description or ()]
        return dict(zip(names, row, strict=True)) if row else None

    async def counts(self, conn: AsyncConnection[Row]) -> dict[tuple[str, str], int]:
        """``{(source, status): count}`` over the whole inbox."""
        check_connection(conn, AsyncConnection, self)
        with translate_errors("counting inbox events"):
            cur = cursor(conn)
            await cur.execute(self._sql.counts)
            return {(source, status): n for source, status, n in await cur.fetchall()}


def _check_delivery(delivery: object) -> None:
    """What the statement needs of a delivery, refused here rather than as an AttributeError or
    a JSON encoder's TypeError in the middle of building it."""
    check_instance(delivery, Delivery, "each delivery", "the receiver builds them")
    assert isinstance(delivery, Delivery)
    if type(delivery.event_id) is not str or type(delivery.source) is not str:
        raise UsageError("a delivery's source and event_id must be str")
    if type(delivery.body) is not bytes or type(delivery.digest) is not bytes:
        raise UsageError("a delivery's body and digest must be bytes (core.inbox.digest(body))")
    if delivery.ordering is not None and not isinstance(delivery.ordering, Ordering):
        raise UsageError(
            f"a delivery's ordering must be an Ordering or None, not {describe(delivery.ordering)}"
        )
    headers = delivery.headers
    if not isinstance(headers, Mapping) or not all(
        type(name) is str and type(value) is str for name, value in headers.items()
    ):
        raise UsageError("a delivery's headers must be a mapping of str to str")


def _check_event(event: object) -> None:
    check_instance(event, InboxEvent, "the event", "pass an event that claim() returned")
