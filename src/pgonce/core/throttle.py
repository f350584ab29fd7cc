"""How often a repeated failure is reported: the first at once, then at most once per interval.

A broken broker refuses every row, and a failing handler fails every event of a source: logging
each would flood the log and hide everything else. The relay and the inbox workers report the
first failure of a kind (an aggregate type or a source, and a reason) when it happens, then hold
back the same kind for ``interval``, and say on the next report how many were held back. Counting
every one of them is the metrics' job. No I/O: the caller passes the clock. One throttle may be
shared by threads (the sync inbox batches of a process share one).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from datetime import datetime, timedelta

#: A failure that goes on is reported again after this long: often enough to see that it is still
#: happening, rarely enough that one broken destination writes a line a minute, not a line a row.
DEFAULT_INTERVAL = timedelta(minutes=1)
#: Kinds remembered at once; past this the oldest is forgotten (and reported again when it recurs),
#: so that a stream of distinct reasons cannot grow the memory without bound.
MAX_KINDS = 1000


class Throttle:
    """Decides, per kind of failure, whether this occurrence is logged."""

    def __init__(self, interval: timedelta = DEFAULT_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[Hashable, datetime] = {}
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def admit(self, kind: Hashable, now: datetime) -> int | None:
        """``None`` to hold this occurrence back; else how many of ``kind`` were held back since
        the last one reported (0 for the first)."""
        with self._lock:
            return self._admit(kind, now)

    def _admit(self, kind: Hashable, now: datetime) -> int | None:
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        if last is None and len(self._last) >= MAX_KINDS:
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._held.pop(oldest, None)
        self._last.pop(kind, None)
        self._last[kind] = now
        return self._held.pop(kind, 0)


def held_back(count: int) -> str:
    """The suffix a report carries when occurrences of its kind were held back before it."""
    if not count:
        return ""
    return f" ({count} more like it since the last report)"
