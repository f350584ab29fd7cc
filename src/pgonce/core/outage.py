"""A run of failures of a background loop, logged once rather than once a tick.

A loop that retries on a timer (the inbox worker's connections, the completer, the sweeper, a
lease's heartbeat) fails at every tick while the database is away. :class:`FailureRun` keeps the
count of the failures in a row and says which line each one is worth: the first at warning level
(or the level given), saying what happens next; the following ones at debug level, with the
count; the success that ends the run once, at info level. Each failure also goes to the loop's
``on_failure`` callback (metrics), when there is one.

The messages are the caller's, as ``%``-style templates with named fields (``%(name)s``): they
are formatted by logging only when a line is written, and ``count`` is the failures in a row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

__all__ = ["FailureRun", "cut_by", "server_setting"]


class FailureRun:
    """The failures in a row of one loop (shared by loops that are one to their users).

    ``back`` is the line that ends a run (with ``%(count)d``); ``on_failure`` is called with every
    failure's error."""

    __slots__ = ("back", "in_a_row", "log", "on_failure")

    def __init__(
        self,
        log: logging.Logger,
        back: str,
        on_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        self.log = log
        self.back = back
        self.on_failure = on_failure
        #: Failures since the last success (0: the loop is fine).
        self.in_a_row = 0

    def failed(
        self,
        error: Exception,
        first: str,
        again: str,
        fields: Mapping[str, object],
        *,
        level: int = logging.WARNING,
        exc_info: bool = False,
    ) -> None:
        """One more failure: ``first`` (at ``level``, with ``error``'s traceback if
        ``exc_info``) when it starts a run, ``again`` (at debug level) otherwise, each formatted
        with ``fields``, ``error`` and ``count``."""
        self.in_a_row += 1
        values = {**fields, "error": error, "type": type(error).__name__, "count": self.in_a_row}
        if self.in_a_row == 1:
            self.log.log(level, first, values, exc_info=error if exc_info else None)
        else:
            self.log.debug(again, values)
        if self.on_failure is not None:
            self.on_failure(error)

    def succeeded(self) -> None:
        """The loop works again: a run of failures under way ends, and says so once."""
        if self.in_a_row:
            self.log.info(self.back, {"count": self.in_a_row})
            self.in_a_row = 0

    def ended(self) -> int:
        """Ends a run without its success line (the caller says how it ended); its length."""
        count, self.in_a_row = self.in_a_row, 0
        return count


#: The errors of a statement cut by a server setting, and the setting: the connection is fine.
_CUT_BY = (
    (psycopg.errors.QueryCanceled, "statement_timeout"),
    (psycopg.errors.LockNotAvailable, "lock_timeout"),
)


def cut_by(error: BaseException | None) -> str | None:
    """The setting (statement_timeout, lock_timeout) that cut the statement behind ``error``
    (the store translates its QueryCanceled or LockNotAvailable into a DatabaseUnavailable, the
    psycopg error kept as the cause), or None."""
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
    """``setting``'s value as ``conn`` sees it ({} when there is none, or no answer): asked only
    after a statement it cut, to name it in the report."""
    if conn is None or conn.closed or setting is None:
        return {}
    try:
        async with asyncio.timeout(1):
            await conn.rollback()
            cur = await conn.execute(f"SHOW {setting}")
            row = await cur.fetchone()
            await conn.rollback()
    except (psycopg.Error, TimeoutError):
        return {}
    return {} if row is None else {setting: str(row[0])}
