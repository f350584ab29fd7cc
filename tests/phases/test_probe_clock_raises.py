"""A ``clock`` given to ``call()`` that raises. Read before the call, its error came out as it was
(a ValueError, not pgonce's); read by the heartbeat, it was logged as a failed renewal, "the
database away", and retried at every beat while the lease ran out, and the call's value was
recorded as if the lease had been kept. A clock that raises is a broken contract, as one that
gives a naive datetime: a UsageError before the call, or once its work returns."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import UsageError
from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0


class Clock:
    """Gives T0 ``good`` times, then raises; ``broke`` is set when it raised."""

    def __init__(self, good: int) -> None:
        self.good = good
        self.broke = threading.Event()

    def __call__(self) -> datetime:
        if self.good:
            self.good -= 1
            return T0
        self.broke.set()
        raise ValueError("the clock's source is gone")


def test_a_clock_that_raises_before_the_call_is_a_usage_error(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "t", "before", FP, now=T0)
    called: list[str] = []
    with pytest.raises(UsageError, match="the clock raised ValueError"):
        op.call("charge", called.append, now=T0, clock=Clock(0))
    assert called == []
    assert op.call("charge", lambda key: 1, now=T0) == 1


def test_a_clock_that_raises_in_the_heartbeat_fails_the_call_once_its_work_returns(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore(lease=timedelta(seconds=1)).start(db, "t", "beat", FP, now=T0)
    clock = Clock(1)

    def charge(key: str) -> int:
        assert clock.broke.wait(10)
        return 1

    with pytest.raises(UsageError, match="the clock raised ValueError"):
        op.call("charge", charge, now=T0, clock=clock)
    assert not op.reached("charge")


async def test_an_async_clock_that_raises_before_the_call_is_a_usage_error(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "t", "async", FP, now=T0)

        async def charge(key: str) -> int:
            return 1

        with pytest.raises(UsageError, match="the clock raised ValueError"):
            await op.call("charge", charge, now=T0, clock=Clock(0))
