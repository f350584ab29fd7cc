"""The heartbeat during a third party's call: the lease renewed in the background, fenced.

The clock of the renewals is a parameter: the test moves it past the lease while the call runs
and waits for a renewal at that time to commit (the heartbeat reads the clock once per beat, so
the second read after a move means the first renewal at the new time has ended). Beats come
every 10 ms of real time; no lease decision depends on real time.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import LeaseLost, Response, UsageError
from pgonce.phases import AsyncPhaseStore, PhaseStore
from pgonce.store.heartbeat import NAME
from tests.phases.racer import FP, T0

LEASE = timedelta(seconds=30)
BEAT = timedelta(milliseconds=10)
ANSWER = Response(201, (), b"charged")


class Clock:
    """The heartbeat's clock: the time the test set, and a count of the heartbeat's reads."""

    def __init__(self, at: datetime) -> None:
        self.at = at
        self.reads = 0
        self._read = threading.Condition()

    def __call__(self) -> datetime:
        with self._read:
            self.reads += 1
            self._read.notify_all()
            return self.at

    def move_and_beat(self, at: datetime) -> None:
        """Move the clock to ``at``; return once a renewal at ``at`` has committed."""
        with self._read:
            self.at = at
            after = self.reads + 2
            assert self._read.wait_for(lambda: self.reads >= after, timeout=10)


def heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == NAME]


def lease_of(db: psycopg.Connection[Any], key: str) -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT token, locked_until, point, state FROM pgonce.key_leases WHERE key = %s", (key,)
    ).fetchone()


def test_a_call_longer_than_the_lease_keeps_the_key(dsn: str, db: psycopg.Connection[Any]) -> None:
    store = PhaseStore(lease=LEASE, heartbeat=BEAT)
    clock = Clock(T0)
    seen: list[bool] = []
    with psycopg.connect(dsn, autocommit=True) as holder:
        op = store.start(holder, "t", "h1", FP, now=T0)

        def charge(idem: str) -> dict[str, str]:
            # The call lasts three leases; at each step another client retries the key.
            for step in range(1, 7):
                at = T0 + step * LEASE / 2
                clock.move_and_beat(at)
                duplicate = store.start(db, "t", "h1", FP, now=at + LEASE / 3)
                seen.append(duplicate.in_flight)
            return {"charge": idem}

        value = op.call("charge", charge, now=T0 + 3 * LEASE, clock=clock)
        assert seen == [True] * 6  # never taken over
        assert value == {"charge": op.idempotency_key("charge")}
        assert not heartbeats()  # stopped with the call
        row = lease_of(db, "h1")
        assert row is not None
        assert row[0] == op.token
        assert row[2] == "charge"
        assert op.finish(ANSWER, now=T0 + 3 * LEASE)


def test_without_a_heartbeat_the_same_call_would_be_taken_over(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    # The control for the test above: the same duplicate, with the clock moved but no renewal.
    store = PhaseStore(lease=LEASE)
    op = store.start(db, "t", "h2", FP, now=T0)
    duplicate = store.start(db, "t", "h2", FP, now=T0 + LEASE / 2 + LEASE / 3 + LEASE / 2)
    assert duplicate.won
    assert duplicate.token > op.token


def test_a_heartbeat_that_finds_the_key_taken_over_loses_the_call(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    store = PhaseStore(lease=LEASE, heartbeat=BEAT)
    clock = Clock(T0)
    taken: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as holder:
        op = store.start(holder, "t", "h3", FP, now=T0)

        def charge(idem: str) -> str:
            # The holder stalls (a paused process, a long garbage collection): its lease ran
            # out at T0 + LEASE, and a retry takes the key over.
            retry = store.start(db, "t", "h3", FP, now=T0 + 2 * LEASE)
            assert retry.won
            taken.append(retry.token)
            # The next renewal is refused: the heartbeat ends by itself, during the call.
            (beating,) = heartbeats()
            beating.join(timeout=10)
            assert not beating.is_alive()
            assert op.lost
            return "late"

        with pytest.raises(LeaseLost):
            op.call("charge", charge, clock=clock)
        assert "charge" not in op.state
        # The new holder's lease is untouched: the zombie recorded nothing.
        row = lease_of(db, "h3")
        assert row is not None
        assert (row[0], row[2], row[3]) == (taken[0], None, {})
        # And no later write of the old holder is even tried.
        with pytest.raises(LeaseLost):
            op.finish(ANSWER)


def test_the_heartbeat_stops_when_the_call_raises(dsn: str, db: psycopg.Connection[Any]) -> None:
    store = PhaseStore(lease=LEASE, heartbeat=BEAT)
    clock = Clock(T0)
    op = store.start(db, "t", "h4", FP, now=T0)

    def charge(idem: str) -> str:
        clock.move_and_beat(T0 + LEASE)
        raise ConnectionError("the provider hung up")

    with pytest.raises(ConnectionError):
        op.call("charge", charge, clock=clock)
    assert not heartbeats()
    row = lease_of(db, "h4")
    assert row is not None
    assert row[1] == T0 + 2 * LEASE  # renewed at T0 + LEASE, nothing recorded
    op.fail("the provider hung up", now=T0 + LEASE)  # the connection is idle again


def test_the_heartbeat_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(UsageError, match="shorter than the lease"):
        PhaseStore(lease=LEASE, heartbeat=LEASE)
    with pytest.raises(UsageError, match="timedelta"):
        PhaseStore(heartbeat=5)  # type: ignore[arg-type]
    assert PhaseStore(lease=LEASE).heartbeat == LEASE / 3


async def test_the_async_heartbeat_keeps_the_key_during_a_long_call(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    store = AsyncPhaseStore(lease=LEASE, heartbeat=BEAT)
    at = [T0]
    reads = [0]
    read = asyncio.Event()

    def clock() -> datetime:
        reads[0] += 1
        read.set()
        return at[0]

    async def move_and_beat(to: datetime) -> None:
        at[0] = to
        after = reads[0] + 2
        while reads[0] < after:
            read.clear()
            await asyncio.wait_for(read.wait(), 10)

    seen: list[bool] = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder:
        op = await store.start(holder, "t", "h5", FP, now=T0)

        async def charge(idem: str) -> str:
            for step in range(1, 5):
                when = T0 + step * LEASE / 2
                await move_and_beat(when)
                duplicate = PhaseStore().start(db, "t", "h5", FP, now=when + LEASE / 3)
                seen.append(duplicate.in_flight)
            return idem

        assert await op.call("charge", charge, clock=clock) == op.idempotency_key("charge")
        assert seen == [True] * 4
        assert not [t for t in asyncio.all_tasks() if t.get_name() == NAME]
        row = lease_of(db, "h5")
        assert row is not None
        assert (row[0], row[2]) == (op.token, "charge")


class FlakyRenewal:
    """A renewal that fails ``failing`` times in a row, then succeeds; ``done`` once it did."""

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.done = threading.Event()

    def __call__(self) -> None:
        if self.failing:
            self.failing -= 1
            raise psycopg.OperationalError("the server closed the connection")
        self.done.set()


def test_a_run_of_failed_renewals_is_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pgonce.store.heartbeat import Heartbeat

    renew = FlakyRenewal(failing=3)
    with caplog.at_level("DEBUG", logger="pgonce.phases"), Heartbeat(renew, BEAT) as heartbeat:
        assert renew.done.wait(timeout=10)
    assert heartbeat.failures == 3
    assert not heartbeat.lost
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in levels if level == "WARNING"]
    assert len(warnings) == 1
    assert "tries again every" in warnings[0]
    assert "OperationalError" in warnings[0]
    assert [level for level, _ in levels].count("DEBUG") == 2
    assert [m for level, m in levels if level == "INFO"] == [
        "a lease's heartbeat renewed the lease again after 3 failures"
    ]


async def test_the_async_heartbeat_logs_a_run_of_failures_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pgonce.store.heartbeat import AsyncHeartbeat

    renewed = asyncio.Event()
    failing = [2]

    async def renew() -> None:
        if failing[0]:
            failing[0] -= 1
            raise psycopg.OperationalError("the server closed the connection")
        renewed.set()

    with caplog.at_level("WARNING", logger="pgonce.phases"):
        async with AsyncHeartbeat(renew, BEAT) as heartbeat:
            await asyncio.wait_for(renewed.wait(), 10)
    assert heartbeat.failures == 2
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
