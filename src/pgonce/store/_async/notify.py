"""LISTEN for the wake-ups of the inbox workers and the outbox relays.

This file is the source of ``_sync/notify.py`` (``tools/gen_sync.py``).
"""

from __future__ import annotations

from typing import TypeVar

from psycopg import AsyncConnection, sql

from pgonce.store.cursors import cursor
from pgonce.store.errors import translate_errors

Row = TypeVar("Row")


async def listen(conn: AsyncConnection[Row], channel: str, what: str) -> None:
    """Subscribe ``conn`` (a dedicated, direct, autocommit connection) to ``channel``.

    LISTEN takes the channel as an identifier, not a parameter, so the statement is composed with
    :class:`psycopg.sql.Identifier` from pgonce's own schema name, never from input. Behind a
    transaction-mode pooler the subscription would not survive: give it a direct connection.
    """
    statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
    with translate_errors(f"listening for {what} notifications"):
        await cursor(conn).execute(statement)
