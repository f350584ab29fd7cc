"""The operator console's reads: keys, inbox events and outbox rows by keyset, and chart series.

Nothing here writes (replays go through the inbox's and the outbox's own ``replay``), and nothing
is on a hot path; each listing reads an index range (``queries/console.sql``). This file is the
source of ``_sync/console.py`` (``tools/gen_sync.py``); edit this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from psycopg import AsyncConnection

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.frozen import refuse_changes
from pgonce.sql import Queries
from pgonce.store._async.inspect import EventSummary
from pgonce.store.common import check_schema
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")

#: Rows of one page of a listing.
PAGE = 50
#: The bound of a first page: every row sorts before it (newest first), whatever its other keys.
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)
_MAX_ID = 2**63 - 1
#: The inbox statuses, each with the statement (and the index) that lists it.
EVENT_LISTS = {
    "dead": "events_dead",
    "pending": "events_pending",
    "done": "events_finished",
    "skipped": "events_finished",
    "finished": "events_finished",  # done and skipped
}


@refuse_changes
@dataclass(frozen=True, slots=True)
class KeySummary:
    scope: str
    key: str
    claimed_at: datetime
    completed_at: datetime | None
    response_status: int | None


@refuse_changes
@dataclass(frozen=True, slots=True)
class KeyDetail:
    """What was asked (the fingerprint) and what was answered, byte for byte."""

    scope: str
    key: str
    fingerprint: str
    claimed_at: datetime
    completed_at: datetime | None
    response_status: int | None
    #: ``[[name, value], ...]`` in the order sent; ``None`` while no response is stored.
    response_headers: list[list[str]] | None
    response_body: bytes | None


@refuse_changes
@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    aggregatetype: str
    aggregateid: str
    type: str
    created_at: datetime
    published_at: datetime | None
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    parked_at: datetime | None

    @property
    def state(self) -> str:
        if self.published_at is not None:
            return "published"
        if self.parked_at is not None:
            return "parked"
        return "waiting" if self.attempts else "pending"


@refuse_changes
@dataclass(frozen=True, slots=True)
class OutboxDetail(OutboxRow):
    #: The payload and headers as PostgreSQL prints the jsonb (text, never parsed for display).
    payload: str
    headers: str


@refuse_changes
@dataclass(frozen=True, slots=True)
class EventCursor:
    """Where the next page of events starts: the last row's sort key."""

    received_at: datetime
    source: str
    event_id: str


@refuse_changes
@dataclass(frozen=True, slots=True)
class SweepMark:
    target: str
    scope: str
    deleted: int
    newest: datetime
    swept_at: datetime


class AsyncConsoleReader:
    """The console's queries; each runs in the caller's connection, as a short read."""

    def __init__(self, *, schema: str = DEFAULT_SCHEMA) -> None:
        self._sql = Queries("console", check_schema(schema))

    async def _rows(
        self, conn: AsyncConnection[Row], name: str, params: dict[str, Any], what: str
    ) -> list[tuple[Any, ...]]:
        with translate_errors(what):
            cur = cursor(conn)
            await cur.execute(getattr(self._sql, name), params)
            return await cur.fetchall()

    async def keys(
        self,
        conn: AsyncConnection[Row],
        scope: str,
        prefix: str = "",
        *,
        after: str = "",
        limit: int = PAGE,
    ) -> list[KeySummary]:
        """A scope's keys starting with ``prefix``, in key order, after the key ``after``."""
        params = {"scope": scope, "prefix": prefix, "after": after, "limit": limit}
        return [KeySummary(*r) for r in await self._rows(conn, "keys_page", params, "listing keys")]

    async def key(self, conn: AsyncConnection[Row], scope: str, key: str) -> KeyDetail | None:
        rows = await self._rows(conn, "key_detail", {"scope": scope, "key": key}, "reading a key")
        if not rows:
            return None
        values = list(rows[0])
        if values[-1] is not None:
            values[-1] = bytes(values[-1])
        return KeyDetail(*values)

    async def events(
        self,
        conn: AsyncConnection[Row],
        status: str,
        *,
        source: str | None = None,
        after: EventCursor | None = None,
        limit: int = PAGE,
    ) -> list[EventSummary]:
        """Events of one status, newest first, after ``after``; ``status`` is a key of
        :data:`EVENT_LISTS`."""
        name = EVENT_LISTS[status]
        params = {
            "source": source,
            "status": status if status in ("done", "skipped") else None,
            "after_at": after.received_at if after else _FAR_FUTURE,
            "after_source": after.source if after else "",
            "after_id": after.event_id if after else "",
            "limit": limit,
        }
        rows = await self._rows(conn, name, params, "listing inbox events")
        return [EventSummary(*r) for r in rows]

    async def event_by_id(
        self, conn: AsyncConnection[Row], sources: list[str], event_id: str
    ) -> list[EventSummary]:
        params = {"sources": sources, "event_id": event_id}
        rows = await self._rows(conn, "event_by_id", params, "finding an inbox event")
        return [EventSummary(*r) for r in rows]

    async def outbox(
        self,
        conn: AsyncConnection[Row],
        state: str | None = None,
        *,
        aggregatetype: str | None = None,
        aggregateid: str | None = None,
        after: int | None = None,
        limit: int = PAGE,
    ) -> list[OutboxRow]:
        """Outbox rows, newest first: ``state`` None (any), pending, parked or published."""
        name = {"pending": "outbox_page_pending", "parked": "outbox_page_parked"}.get(
            state or "", "outbox_page"
        )
        params = {
            "after_id": _MAX_ID if after is None else after,
            "published": state == "published",
            "aggregatetype": aggregatetype,
            "aggregateid": aggregateid,
            "limit": limit,
        }
        rows = await self._rows(conn, name, params, "listing outbox rows")
        return [OutboxRow(*r) for r in rows]

    async def outbox_row(self, conn: AsyncConnection[Row], row_id: int) -> OutboxDetail | None:
        rows = await self._rows(conn, "outbox_detail", {"id": row_id}, "reading an outbox row")
        return OutboxDetail(*rows[0]) if rows else None

    async def outbox_counts(self, conn: AsyncConnection[Row]) -> list[tuple[str, str, int]]:
        """``(aggregatetype, "pending" | "parked", rows)`` of the rows not yet published."""
        rows = await self._rows(conn, "outbox_counts_by_type", {}, "counting outbox rows")
        return [(str(a), str(s), int(n)) for a, s, n in rows]

    async def series(
        self,
        conn: AsyncConnection[Row],
        name: str,
        since: datetime,
        step: timedelta,
        span: timedelta,
    ) -> list[tuple[Any, ...]]:
        """The rows of chart statement ``name`` (``chart_*`` in console.sql): ``(bucket, ...)``."""
        params = {"since": since, "step_s": step.total_seconds(), "span": span}
        return await self._rows(conn, f"chart_{name}", params, f"reading the {name} chart")

    async def sweep_marks(self, conn: AsyncConnection[Row]) -> list[SweepMark]:
        rows = await self._rows(conn, "sweep_marks", {}, "reading what the sweeper deleted")
        return [SweepMark(*r) for r in rows]
