"""The retry curve shared by the inbox workers and the outbox relay."""

from __future__ import annotations

from datetime import timedelta

from pgonce.errors import UsageError


def capped_exponential(base: timedelta, cap: timedelta, attempts: int) -> timedelta:
    """``min(cap, base * 2 ** (attempts - 1))``: the delay after the ``attempts``-th failure,
    before any jitter (each caller spreads it its own way)."""
    if attempts < 1:
        raise UsageError("a backoff is computed after at least one failure")
    # 2 ** 40 base delays are far past any cap; the bound keeps the number small.
    return min(cap, base * (1 << min(attempts - 1, 40)))
