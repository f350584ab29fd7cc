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

import logging
from collections.abc import Callable, Mapping

__all__ = ["FailureRun"]


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
