"""The retry curve shared by the inbox workers and the outbox relay."""

from __future__ import annotations

from datetime import timedelta

from pgonce.errors import UsageError


def capped_exponential(base: timedelta, cap: timedelta, attempts: int) -> timedelta:
    """``min(cap, base * 2 ** (attempts - 1))``: the delay after the ``attempts``-th failure,
    before any jitter (each caller spreads it its own way)."""
    if attempts < 1:
        raise UsageError("a backoff is computed after at least one failure")
    doublings = attempts - 1
    # Once 2 ** doublings passes cap // base the delay is the cap: multiplying further changes
    # nothing but can overflow timedelta (an hour's base passed its limit at the 36th failure,
    # and ended the inbox worker or the relay that computed it).
    if doublings >= (cap // base).bit_length():
        return cap
    return base * (1 << doublings)
