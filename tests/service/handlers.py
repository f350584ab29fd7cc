"""Handlers the service tests configure by name (``tests.service.handlers:...``).

:func:`fail_until_fixed` stands for a handler with a bug that is fixed later: it raises until the
row ``fixed`` exists in ``service_test.flags``, then records its effect, one row per event, in
``service_test.effects`` (no unique constraint: a second run would show as a second row).
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from pgonce.core.inbox import InboxEvent

SETUP = (
    "CREATE SCHEMA IF NOT EXISTS service_test; "
    "CREATE TABLE IF NOT EXISTS service_test.flags (name text PRIMARY KEY); "
    "CREATE TABLE IF NOT EXISTS service_test.effects "
    "(id bigserial PRIMARY KEY, source text NOT NULL, event_id text NOT NULL)"
)
FIX = "INSERT INTO service_test.flags (name) VALUES ('fixed') ON CONFLICT DO NOTHING"
BROKEN = "the handler is broken until service_test.flags holds 'fixed'"


async def fail_until_fixed(event: InboxEvent, conn: AsyncConnection[Any]) -> None:
    """Raise until the ``fixed`` flag is set; then record the event's effect."""
    cur = await conn.execute("SELECT 1 FROM service_test.flags WHERE name = 'fixed'")
    if await cur.fetchone() is None:
        raise RuntimeError(BROKEN)
    await conn.execute(
        "INSERT INTO service_test.effects (source, event_id) VALUES (%s, %s)",
        (event.source, event.id),
    )


#: What :func:`sleep_for_an_hour` runs, to be found in ``pg_stat_activity``.
SLEEP = "SELECT pg_sleep(3600) /* a handler that outlives any stop */"


async def sleep_for_an_hour(event: InboxEvent, conn: AsyncConnection[Any]) -> None:
    """A handler far longer than any stop's bound: a statement of an hour."""
    await conn.execute(SLEEP)
