"""Two-phase holders at the edges of their contract: a connection the caller left inside a
transaction, a lease too long for the clock, and a key the holder released itself.

Each case first failed on real PostgreSQL: a renewal or an end of lease nested as a savepoint in
the caller's transaction (and lost with its rollback, while the holder believed it kept the key),
a call recorded in a transaction pgonce was not handed (passed in memory, never committed), a
lease that failed at the claim or killed the heartbeat's thread in silence. The race of retries
in processes of their own for one expired lease held from the start, and stays as a guard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgonce import DatabaseUnavailable, KeyMismatch, LeaseLost, Response, UsageError
from pgonce import fingerprint as make_fingerprint
from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0

LEASE = timedelta(seconds=30)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def holder(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection as most applications open one: not in autocommit, so that any statement of
    the caller's opens a transaction that stays open until the caller ends it."""
    with psycopg.connect(dsn) as c:
        yield c


def lease_row(admin: psycopg.Connection[Any], key: str) -> tuple[Any, ...]:
    row = admin.execute(
        "SELECT token, locked_until, last_error, state FROM pgonce.key_leases WHERE key = %s",
        (key,),
    ).fetchone()
    assert row is not None
    return tuple(row)


# A connection inside the caller's transaction


def test_a_renewal_inside_the_callers_transaction_is_refused(
    holder: psycopg.Connection[Any], admin: psycopg.Connection[Any]
) -> None:
    store = PhaseStore(lease=LEASE)
    op = store.start(holder, "t", "renew-in-tx", FP, now=at(0))
    assert op.won
    holder.execute("SELECT 1")  # the caller's own transaction, still open
    with pytest.raises(UsageError, match="idle"):
        op.renew(now=at(20))
    holder.rollback()
    # Nothing was renewed, and the holder was told so: at 35 s the lease taken at 0 has run out.
    assert lease_row(admin, "renew-in-tx")[1] == at(30)
    other = store.start(admin, "t", "renew-in-tx", FP, now=at(35))
    assert other.won
    assert other.resumed


def test_ending_a_lease_inside_the_callers_transaction_is_refused(
    holder: psycopg.Connection[Any], admin: psycopg.Connection[Any]
) -> None:
    store = PhaseStore(lease=LEASE)
    op = store.start(holder, "t", "fail-in-tx", FP, now=at(0))
    holder.execute("SELECT 1")
    with pytest.raises(UsageError, match="idle"):
        op.fail("the provider is down", now=at(5))
    holder.rollback()
    assert lease_row(admin, "fail-in-tx")[1:3] == (at(30), None)
    op.fail("the provider is down", now=at(5))  # idle again: the lease ends, committed
    assert lease_row(admin, "fail-in-tx")[1:3] == (at(5), "the provider is down")


def test_a_call_whose_work_opened_a_transaction_on_the_connection_is_not_recorded(
    holder: psycopg.Connection[Any], admin: psycopg.Connection[Any]
) -> None:
    store = PhaseStore(lease=LEASE)
    op = store.start(holder, "t", "call-in-tx", FP, now=at(0))

    def charge(idempotency_key: str) -> dict[str, str]:
        holder.execute("SELECT 1")  # against the contract: the work uses the connection
        return {"charge": "ch_1"}

    with pytest.raises(UsageError, match="must not use"):
        op.call("charge", charge, now=at(1))
    assert not op.reached("charge")
    holder.rollback()
    assert lease_row(admin, "call-in-tx")[3] == {}
    assert op.call("charge", lambda _: {"charge": "ch_1"}, now=at(2)) == {"charge": "ch_1"}
    assert lease_row(admin, "call-in-tx")[3] == {"charge": {"charge": "ch_1"}}


async def test_an_async_call_whose_work_opened_a_transaction_is_not_recorded(
    dsn: str, admin: psycopg.Connection[Any]
) -> None:
    store = AsyncPhaseStore(lease=LEASE)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        op = await store.start(conn, "t", "acall-in-tx", FP, now=at(0))

        async def charge(idempotency_key: str) -> dict[str, str]:
            await conn.execute("SELECT 1")
            return {"charge": "ch_1"}

        with pytest.raises(UsageError, match="must not use"):
            await op.call("charge", charge, now=at(1))
        assert not op.reached("charge")
        await conn.rollback()
    assert lease_row(admin, "acall-in-tx")[3] == {}


def test_work_that_fails_inside_its_own_transaction_keeps_its_error_and_says_so(
    holder: psycopg.Connection[Any], admin: psycopg.Connection[Any]
) -> None:
    # Before: the end of the lease was a savepoint of the work's transaction, lost with its
    # rollback, while nothing said the lease was still running.
    op = PhaseStore(lease=LEASE).start(holder, "t", "run-in-tx", FP, now=at(0))

    def work(op: Any) -> Response:
        holder.execute("SELECT 1")
        raise RuntimeError("the ledger is down")

    with pytest.raises(RuntimeError, match="the ledger is down") as raised:
        op.run(work, now=at(1))
    assert any("did not end the lease" in note for note in raised.value.__notes__)
    holder.rollback()
    assert lease_row(admin, "run-in-tx")[1:3] == (at(30), None)


# Leases the clock cannot hold


@pytest.mark.parametrize(
    "lease", [timedelta(days=999_999_999), timedelta(days=365 * 1000), timedelta(days=2)]
)
def test_a_lease_longer_than_a_day_is_refused_by_the_store(lease: timedelta) -> None:
    # Before: the first two failed late (the claim's timestamp out of range; the heartbeat's
    # thread dying of an OverflowError that no log of pgonce's showed).
    with pytest.raises(UsageError, match="at most"):
        PhaseStore(lease=lease)
    with pytest.raises(UsageError, match="at most"):
        AsyncPhaseStore(lease=lease)


def test_a_lease_of_a_day_still_claims_and_beats(admin: psycopg.Connection[Any]) -> None:
    store = PhaseStore(lease=timedelta(days=1))
    op = store.start(admin, "t", "a-day", FP, now=at(0))
    assert op.call("charge", lambda _: 1, now=at(1)) == 1
    assert lease_row(admin, "a-day")[1] == at(1) + timedelta(days=1)


# A key the holder released itself


def test_writes_after_release_are_usage_errors_not_a_lost_lease(
    admin: psycopg.Connection[Any],
) -> None:
    op = PhaseStore(lease=LEASE).start(admin, "t", "released", FP, now=at(0))
    op.release(now=at(1))
    # Nobody took the key over: LeaseLost would send a caller looking for a new holder.
    for write in (
        lambda: op.phase("create", lambda _: 1, now=at(2)),
        lambda: op.finish(Response(201, body=b"late"), now=at(2)),
        lambda: op.fail("late", now=at(2)),
        lambda: op.renew(now=at(2)),
        lambda: op.release(now=at(2)),
    ):
        with pytest.raises(UsageError, match="released"):
            write()


# A connection lost between phases


def test_every_write_after_a_lost_connection_is_database_unavailable(
    dsn: str, admin: psycopg.Connection[Any]
) -> None:
    # Before: the first write raised DatabaseUnavailable, every later phase, call, finish or
    # release a UsageError saying the connection was inside a transaction, which it was not.
    conn = psycopg.connect(dsn, autocommit=True)
    op = PhaseStore(lease=LEASE).start(conn, "t", "lost", FP, now=at(0))
    admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    writes: list[Callable[[], object]] = [
        lambda: op.phase("create", lambda _: 1, now=at(1)),
        lambda: op.phase("create", lambda _: 1, now=at(1)),
        lambda: op.release(now=at(1)),
        lambda: op.renew(now=at(1)),
        lambda: op.fail("down", now=at(1)),
        lambda: op.finish(Response(201, body=b"paid"), now=at(1)),
        lambda: op.call("charge", lambda _: 1, now=at(1)),
    ]
    for write in writes:
        with pytest.raises(DatabaseUnavailable):
            write()
    assert op.state == {}
    assert not op.stored
    assert lease_row(admin, "lost")[1] == at(30)


# Names and values of phases


def test_a_phase_name_run_twice_by_one_holder_is_refused(admin: psycopg.Connection[Any]) -> None:
    # Before: a loop that named every step "charge" ran the first and returned its value for
    # the others, which never ran, without a word.
    op = PhaseStore(lease=LEASE).start(admin, "t", "reused", FP, now=at(0))
    charged: list[int] = []

    def charge(amount: int) -> Any:
        def work(idempotency_key: str) -> int:
            charged.append(amount)
            return amount

        return work

    assert op.call("charge", charge(10), now=at(1)) == 10
    with pytest.raises(UsageError, match="already ran"):
        op.call("charge", charge(20), now=at(2))
    with pytest.raises(UsageError, match="already ran"):
        op.phase("charge", lambda _: 30, now=at(2))
    assert charged == [10]
    assert op.call("charge-2", charge(20), now=at(3)) == 20


def test_a_resumed_holder_skips_each_passed_phase_once(admin: psycopg.Connection[Any]) -> None:
    store = PhaseStore(lease=LEASE)
    first = store.start(admin, "t", "resumed-once", FP, now=at(0))
    first.phase("create", lambda _: {"id": 1}, now=at(1))
    second = store.start(admin, "t", "resumed-once", FP, now=at(60))
    assert second.resumed
    assert second.phase("create", lambda _: {"id": 2}, now=at(61)) == {"id": 1}
    with pytest.raises(UsageError, match="already ran"):
        second.phase("create", lambda _: {"id": 3}, now=at(62))


def test_a_negative_zero_is_refused_as_a_recorded_value() -> None:
    # jsonb keeps numbers as numeric, which has no negative zero: -0.0 came back as 0.0.
    from pgonce.core.leases import check_state

    with pytest.raises(UsageError, match="negative zero"):
        check_state({"delta": -0.0}, "refund")
    check_state({"delta": 0.0}, "refund")


def test_a_holder_that_called_a_third_party_cannot_release_the_key(
    admin: psycopg.Connection[Any],
) -> None:
    # Before: the call's value could not be recorded (a tuple), so no phase was, and release()
    # freed the key; the next request with that key, another one, handed the provider the same
    # idempotency key and was answered the first request's charge.
    store = PhaseStore(lease=LEASE)
    op = store.start(admin, "t", "called", FP, now=at(0))
    with pytest.raises(UsageError, match="does not give back"):
        op.call("charge", lambda _: ("ch_1", 4200), now=at(1))
    assert op.state == {}
    with pytest.raises(UsageError, match="called a third party"):
        op.release(now=at(2))
    op.fail("the charge could not be recorded", now=at(2))
    other = make_fingerprint("POST", "/payments", b'{"amount": 1}')
    assert store.start(admin, "t", "called", FP, now=at(3)).resumed
    with pytest.raises(KeyMismatch):
        store.start(admin, "t", "called", other, now=at(100))


def test_a_resumed_holder_cannot_release_a_key_an_earlier_holder_may_have_charged(
    admin: psycopg.Connection[Any],
) -> None:
    store = PhaseStore(lease=LEASE)
    first = store.start(admin, "t", "charged-then-died", FP, now=at(0))
    charged: list[str] = []

    def charge_and_die(idempotency_key: str) -> None:
        charged.append(idempotency_key)
        raise ConnectionResetError("the holder's process died before the record")

    with pytest.raises(ConnectionResetError):
        first.call("charge", charge_and_die, now=at(1))
    second = store.start(admin, "t", "charged-then-died", FP, now=at(60))
    assert second.resumed
    assert second.state == {}
    # Released, the key would be a new claim for another request, whose charge would hand the
    # provider the idempotency key the first request was charged with.
    with pytest.raises(UsageError, match="took its key over"):
        second.release(now=at(61))
    second.fail("refused before the endpoint began", now=at(61))
    other = make_fingerprint("POST", "/payments", b'{"amount": 1}')
    with pytest.raises(KeyMismatch):
        store.start(admin, "t", "charged-then-died", other, now=at(62))
    third = store.start(admin, "t", "charged-then-died", FP, now=at(62))
    assert third.resumed
    assert third.idempotency_key("charge") == charged[0]


# Retries racing for one expired lease, each a process of its own


def test_retries_racing_for_an_expired_lease_make_one_holder(
    dsn: str, admin: psycopg.Connection[Any]
) -> None:
    admin.execute("CREATE TABLE race_payments (key text PRIMARY KEY, holder int)")
    dead = PhaseStore(lease=LEASE).start(admin, "t", "race", FP, now=at(0))
    assert dead.won  # and never heard of again: its lease runs out at 30 s
    root = Path(__file__).resolve().parents[2]
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.phases.racer", dsn, "race", "60"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    try:
        for racer in racers:
            assert racer.stdout is not None
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:  # all at once: each has its connection open already
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        outcomes = []
        for racer in racers:
            out, _ = racer.communicate(timeout=60)
            assert racer.returncode == 0, out
            outcomes.append(json.loads(out.splitlines()[-1]))
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
    won = [o for o in outcomes if o["claim"] == "won"]
    assert len(won) == 1, outcomes
    assert won[0]["stored"] is True
    assert won[0]["token"] > dead.token
    assert {o["claim"] for o in outcomes} <= {"won", "in_flight", "replay"}
    rows = admin.execute("SELECT holder FROM race_payments").fetchall()
    assert len(rows) == 1
    with pytest.raises(LeaseLost):
        dead.phase("create", lambda _: 0, now=at(61))


# A call begun late in its lease


def test_a_call_begun_late_in_its_lease_keeps_the_key_before_the_first_beat(
    admin: psycopg.Connection[Any], dsn: str
) -> None:
    # Before: the first renewal came one heartbeat into the call; a call begun 25 s into a 30 s
    # lease ran with its key up for the taking from 30 s on, and a retry took it over.
    store = PhaseStore(lease=LEASE, heartbeat=timedelta(seconds=10))
    op = store.start(admin, "t", "late-call", FP, now=at(0))
    duplicates: list[str] = []

    def charge(idempotency_key: str) -> str:
        with psycopg.connect(dsn, autocommit=True) as other:
            duplicates.append(store.start(other, "t", "late-call", FP, now=at(31)).claim.kind)
        return "ch_1"

    assert op.call("charge", charge, now=at(32), clock=lambda: at(25)) == "ch_1"
    assert duplicates == ["in_flight"]


def test_a_holder_taken_over_learns_it_before_calling_the_provider(
    admin: psycopg.Connection[Any],
) -> None:
    # Before: a holder that woke past its lease called the provider again, and only its record
    # was refused.
    store = PhaseStore(lease=LEASE)
    op = store.start(admin, "t", "woke-late", FP, now=at(0))
    assert store.start(admin, "t", "woke-late", FP, now=at(60)).won
    called: list[str] = []
    with pytest.raises(LeaseLost):
        op.call("charge", called.append, now=at(61))
    assert called == []


def test_a_takeover_bounded_by_an_age_that_is_not_a_duration_is_refused_at_the_call(
    admin: psycopg.Connection[Any],
) -> None:
    # Before: the number was sent, and PostgreSQL refused to cast it (a DatabaseError).
    store = PhaseStore(lease=LEASE)
    store.start(admin, "t", "aged", FP, now=at(0))
    with pytest.raises(UsageError, match=r"max_age must be a datetime\.timedelta"):
        store.resume(admin, "t", "aged", max_age=60, now=at(60))  # type: ignore[arg-type]
    assert store.resume(admin, "t", "aged", max_age=timedelta(minutes=5), now=at(60)).won


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a phase's work that ends pgonce's transaction itself (COMMIT in its SQL) commits its "
        "writes before the fenced record: a holder taken over meanwhile still writes. Holding "
        "the fence from the phase's start needs the record (or a fenced lock of the lease row) "
        "before the work, which changes what a paused phase keeps"
    ),
)
def test_a_phase_whose_work_commits_by_itself_writes_nothing_once_taken_over(
    admin: psycopg.Connection[Any], dsn: str
) -> None:
    admin.execute("CREATE TABLE ledger (key text)")
    store = PhaseStore(lease=LEASE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        op = store.start(conn, "t", "self-commit", FP, now=at(0))
        assert store.start(admin, "t", "self-commit", FP, now=at(60)).won

        def write(c: psycopg.Connection[Any]) -> int:
            c.execute("INSERT INTO ledger VALUES ('self-commit')")
            c.execute("COMMIT")  # against the contract
            return 1

        with pytest.raises((LeaseLost, UsageError)):
            op.phase("create", write, now=at(61))
    assert admin.execute("SELECT count(*) FROM ledger").fetchone() == (0,)
