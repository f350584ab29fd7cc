"""Read-only views of pgonce's tables for people: the admin page, ``pgonce events`` and metrics.

Nothing here writes, and nothing here is on a hot path. This file is the source of
``_sync/inspect.py`` (``tools/gen_sync.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from psycopg import AsyncConnection

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.checks import check_duration
from pgonce.core.frozen import refuse_changes
from pgonce.errors import UsageError
from pgonce.sql import Queries
from pgonce.store._async.health import answered_within
from pgonce.store.common import check_schema
from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")

#: The most rows a listing returns: a page for people, not an export.
MAX_LIST = 1000


@refuse_changes
@dataclass(frozen=True, slots=True)
class SourceStatus:
    source: str
    status: str
    events: int
    oldest: datetime


@refuse_changes
@dataclass(frozen=True, slots=True)
class EventSummary:
    source: str
    event_id: str
    status: str
    attempts: int
    received_at: datetime
    next_attempt_at: datetime
    processed_at: datetime | None
    last_error: str | None
    bytes: int


@refuse_changes
@dataclass(frozen=True, slots=True)
class EventDetail(EventSummary):
    ordering_key: str | None
    version: int | None
    headers: dict[str, str]
    body: bytes
    digest: str


@refuse_changes
@dataclass(frozen=True, slots=True)
class StuckClaim:
    scope: str
    key: str
    claimed_at: datetime


@refuse_changes
@dataclass(frozen=True, slots=True)
class Trouble:
    """A group of rows that failed and wait: outbox rows of an aggregate type ("waiting" out a
    backoff, or "parked"), or inbox events of a source ("retrying", or "dead")."""

    part: str
    name: str
    state: str
    rows: int
    next_attempt_at: datetime | None
    last_error: str | None


class AsyncInspector:
    """Queries that show what pgonce holds; each runs in its own short read.

    ``timeout`` bounds each query by wall time: on a stalled network (requests arrive, answers
    do not) a query past it closes its connection and raises
    :class:`~pgonce.errors.DatabaseUnavailable` saying so, instead of waiting forever. None (the
    default) leaves the bound to the caller.
    """

    def __init__(self, *, schema: str = DEFAULT_SCHEMA, timeout: timedelta | None = None) -> None:
        if timeout is not None and check_duration(timeout, "timeout") <= timedelta(0):
            raise UsageError(f"timeout must be longer than 0s, not {timeout}")
        self.schema = check_schema(schema)
        self.timeout = timeout
        self._sql = Queries("inspect", schema)

    async def _rows(
        self, conn: AsyncConnection[Row], statement: bytes, params: dict[str, Any], what: str
    ) -> list[tuple[Any, ...]]:
        if self.timeout is None:
            with translate_errors(what):
                cur = cursor(conn)
                await cur.execute(statement, params)
                return await cur.fetchall()
        with answered_within(conn, self.timeout.total_seconds(), what):
            cur = cursor(conn)
            await cur.execute(statement, params)
            return await cur.fetchall()

    async def inbox_overview(self, conn: AsyncConnection[Row]) -> list[SourceStatus]:
        """Events by source and status, handled ones included (a count of the whole inbox)."""
        rows = await self._rows(conn, self._sql.inbox_overview, {}, "reading the inbox overview")
        return [SourceStatus(*row) for row in rows]

    async def inbox_backlog(self, conn: AsyncConnection[Row]) -> list[SourceStatus]:
        """Pending events and dead letters by source, from the partial indexes (any size)."""
        rows = await self._rows(conn, self._sql.inbox_backlog, {}, "reading the inbox backlog")
        return [SourceStatus(*row) for row in rows]

    async def troubles(self, conn: AsyncConnection[Row]) -> list[Trouble]:
        """Refused outbox rows and failed inbox events, grouped, with the newest reason."""
        rows = await self._rows(conn, self._sql.troubles, {}, "reading failed rows")
        return [Trouble(*row) for row in rows]

    async def table_estimates(self, conn: AsyncConnection[Row]) -> dict[str, int]:
        """PostgreSQL's estimate of the rows in the keys, inbox and outbox tables.

        A table not yet vacuumed or analyzed has no estimate and is left out.
        """
        params = {"schema": self.schema}
        rows = await self._rows(conn, self._sql.table_estimates, params, "reading table sizes")
        return {name: int(estimate) for name, estimate in rows if estimate >= 0}

    async def events(
        self,
        conn: AsyncConnection[Row],
        *,
        source: str | None = None,
        status: str | None = None,
        event_id: str | None = None,
        limit: int = 100,
    ) -> list[EventSummary]:
        """Stored events, newest first, filtered by any of source, status and id."""
        params = {
            "source": source,
            "status": status,
            "event_id": event_id,
            "limit": max(1, min(limit, MAX_LIST)),
        }
        rows = await self._rows(conn, self._sql.list_events, params, "listing inbox events")
        return [EventSummary(*row) for row in rows]

    async def event(
        self, conn: AsyncConnection[Row], source: str, event_id: str
    ) -> EventDetail | None:
        params = {"source": source, "event_id": event_id}
        rows = await self._rows(conn, self._sql.event_detail, params, "reading an inbox event")
        if not rows:
            return None
        values = list(rows[0])
        values[-3:-1] = dict(values[-3]), bytes(values[-2])  # headers (jsonb), body (bytea)
        return EventDetail(*values)

    async def stuck_claims(
        self,
        conn: AsyncConnection[Row],
        older_than: timedelta,
        *,
        now: datetime | None = None,
        limit: int = 50,
    ) -> list[StuckClaim]:
        params = {"older_than": older_than, "now": now, "limit": max(1, min(limit, MAX_LIST))}
        rows = await self._rows(conn, self._sql.stuck_claims, params, "listing stuck claims")
        return [StuckClaim(*row) for row in rows]

    async def schema_version(self, conn: AsyncConnection[Row]) -> int:
        """The newest migration applied (0 when none; SchemaNotMigrated without the ledger)."""
        rows = await self._rows(conn, self._sql.schema_version, {}, "reading the schema version")
        return int(rows[0][0])
