"""LISTEN for the wake-ups of the inbox workers and the outbox relays.

This file is the source of ``_sync/notify.py`` (``tools/gen_sync.py``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

from psycopg import AsyncConnection, sql

from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")

#: How long a LISTEN connection's first notification (one sent to it on purpose) may take before
#: its listener concludes that notifications do not reach it.
LISTEN_CHECK = timedelta(seconds=5)

_NOTIFY = "SELECT pg_notify(%s, '')"


async def listen(conn: AsyncConnection[Row], channel: str, what: str) -> None:
    """Subscribe ``conn`` (a dedicated, direct, autocommit connection) to ``channel``.

    LISTEN takes the channel as an identifier, not a parameter, so the statement is composed with
    :class:`psycopg.sql.Identifier` from pgonce's own schema name, never from input. Behind a
    transaction-mode pooler the subscription would not survive: give it a direct connection.
    """
    statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
    with translate_errors(f"listening for {what} notifications"):
        await cursor(conn).execute(statement)


async def hears(
    conn: AsyncConnection[Row],
    sender: AsyncConnection[Any],
    channel: str,
    *,
    within: timedelta = LISTEN_CHECK,
) -> bool:
    """Whether ``conn``, listening on ``channel``, receives within ``within`` a notification that
    ``sender`` (another autocommit connection to the same address) sends to it.

    Through a transaction-mode pooler LISTEN runs, and the server session that ran it goes back
    to the pool: its notifications reach no one. A listener would wait for them in silence, and
    keep registering as waiting, so that every producer notifies (which serializes their commits)
    for nothing. Any notification counts: one a producer sent meanwhile proves delivery as well.
    """
    what = "checking that the LISTEN connection receives notifications"
    with translate_errors(what):
        await cursor(sender).execute(_NOTIFY, (channel,))
    with translate_errors(what):
        async for _ in conn.notifies(timeout=within.total_seconds(), stop_after=1):
            return True
    return False
