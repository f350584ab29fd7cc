"""Statements cut by a timeout the server sets: which setting cut one, and its value.

The store translates a QueryCanceled or a LockNotAvailable into a DatabaseUnavailable (the
psycopg error kept as its cause), which a loop would report as a lost database; the connection is
fine, and the inbox worker and the relay say which setting cut the statement instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pgonce.config import DEFAULT_SCHEMA
from pgonce.sql import query

__all__ = ["cut_by", "server_setting"]

#: The errors of a statement cut by a server setting, and the setting: the connection is fine.
_CUT_BY = (
    (psycopg.errors.QueryCanceled, "statement_timeout"),
    (psycopg.errors.LockNotAvailable, "lock_timeout"),
)


def cut_by(error: BaseException | None) -> str | None:
    """The setting (statement_timeout, lock_timeout) that cut the statement behind ``error``
    (the error itself or one of its first causes), or None."""
    seen = 0
    while error is not None and seen < 5:
        for kind, setting in _CUT_BY:
            if isinstance(error, kind):
                return setting
        error, seen = error.__cause__, seen + 1
    return None


async def server_setting(
    conn: psycopg.AsyncConnection[Any] | None, setting: str | None
) -> dict[str, str]:
    """``setting``'s value as ``conn`` sees it ({} when there is none, or no answer within a
    second): asked only after a statement it cut, to name it in the report.

    The lookup runs under the setting it reads: a statement_timeout of a millisecond or two cuts
    it too whenever the loaded server takes that long over a trivial statement, so a cut lookup
    is asked again, within the same second.
    """
    if conn is None or conn.closed or setting is None:
        return {}
    statement = query("health", "setting", DEFAULT_SCHEMA)
    try:
        async with asyncio.timeout(1):
            while True:
                await conn.rollback()
                try:
                    cur = await conn.execute(statement, {"name": setting})
                    row = await cur.fetchone()
                except psycopg.errors.QueryCanceled:
                    continue  # cut by the timeout it reads: the next try is a new transaction
                await conn.rollback()
                break
    except (psycopg.Error, TimeoutError):
        return {}
    return {} if row is None else {setting: str(row[0])}
