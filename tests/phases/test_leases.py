"""Two-phase keys on real PostgreSQL: leases, takeover, fencing, recovery points, the completer.

The clock is a parameter: every lease decision here is made at a time the test chose.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import InFlight, KeyMismatch, KeyStore, LeaseLost, Replay, Response, UsageError, Won
from pgonce import fingerprint as make_fingerprint
from pgonce.core.leases import provider_key
from pgonce.phases import AsyncPhaseStore, PhasedOperation, PhaseStore
from tests.phases.racer import FP, T0

LEASE = timedelta(seconds=30)
ANSWER = Response(201, (("content-type", "application/json"),), b'{"charge": "ch_1"}')


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (key text PRIMARY KEY, charge text)")
        yield c


@pytest.fixture
def phases() -> PhaseStore:
    return PhaseStore(lease=LEASE)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def insert_payment(key: str) -> Any:
    def write(conn: psycopg.Connection[Any]) -> dict[str, str]:
        conn.execute("INSERT INTO payments (key) VALUES (%s)", (key,))
        return {"payment": key}

    return write


def count(conn: psycopg.Connection[Any], query: str, *params: Any) -> int:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def test_a_claim_commits_at_once_runs_its_phases_and_the_answer_replays(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    op = phases.start(db, "t", "k1", FP, now=at(0))
    assert op.won
    assert not op.resumed
    assert op.token > 0
    # Committed already: another connection sees the claim and its lease.
    assert count(db, "SELECT count(*) FROM pgonce.key_leases WHERE token = %s", op.token) == 1
    assert op.phase("create", insert_payment("k1"), now=at(1)) == {"payment": "k1"}
    charged = op.call("charge", lambda idem: {"id": "ch_1", "idem": idem}, now=at(2))
    assert charged["idem"] == provider_key("t", "k1", "charge") == op.idempotency_key("charge")
    assert op.point == "charge"
    assert op.finish(ANSWER, now=at(3)) is True
    assert count(db, "SELECT count(*) FROM pgonce.key_leases") == 0

    again = phases.start(db, "t", "k1", FP, now=at(4))
    assert again.replayed
    assert again.response == ANSWER
    assert isinstance(again.claim, Replay)
    # The one-transaction path reads the same stored answer.
    with psycopg.connect(db.info.dsn) as other:
        replay = KeyStore().claim(other, "t", "k1", FP)
        assert isinstance(replay, Replay)
        assert replay.response == ANSWER


def test_a_duplicate_is_in_flight_while_the_lease_holds_on_both_paths(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    op = phases.start(db, "t", "k2", FP, now=at(0))
    assert op.won
    with psycopg.connect(db.info.dsn, autocommit=True) as other:
        duplicate = phases.start(other, "t", "k2", FP, now=at(29))
        assert isinstance(duplicate.claim, InFlight)
        assert duplicate.claim.reason == "leased"
        with pytest.raises(UsageError):
            duplicate.phase("create", insert_payment("k2"))
    with psycopg.connect(db.info.dsn) as other:
        claim = KeyStore().claim(other, "t", "k2", FP)
        assert isinstance(claim, InFlight)
        other.rollback()
        begun = KeyStore().begin(other, "t", "k2", FP)
        assert isinstance(begun, InFlight)


def test_another_request_with_the_key_is_a_mismatch(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    phases.start(db, "t", "k3", FP, now=at(0))
    with pytest.raises(KeyMismatch):
        phases.start(db, "t", "k3", make_fingerprint("other"), now=at(100))


def test_an_expired_lease_is_taken_over_with_a_larger_token_and_resumes_after_its_point(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    first = phases.start(db, "t", "k4", FP, now=at(0))
    first.phase("create", insert_payment("k4"), now=at(1))
    # The first holder dies here. Its lease runs until 31 s (renewed by the phase's record).
    with psycopg.connect(db.info.dsn, autocommit=True) as other:
        early = phases.start(other, "t", "k4", FP, now=at(30))
        assert early.in_flight
        second = phases.start(other, "t", "k4", FP, now=at(31))
        assert second.won
        assert second.resumed
        assert second.token > first.token
        assert second.point == "create"
        assert second.attempts == 2
        ran: list[str] = []

        def create_again(conn: psycopg.Connection[Any]) -> dict[str, str]:
            ran.append("create")
            return {"payment": "again"}

        # Skipped: the recorded value comes back, the phase does not run.
        assert second.phase("create", create_again, now=at(32)) == {"payment": "k4"}
        assert ran == []
        second.call("charge", lambda idem: {"id": "ch_4"}, now=at(33))
        assert second.finish(ANSWER, now=at(34))
    assert count(db, "SELECT count(*) FROM payments WHERE key = 'k4'") == 1


def test_a_zombie_holders_writes_are_refused_and_commit_nothing(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    zombie = phases.start(db, "t", "k5", FP, now=at(0))
    with psycopg.connect(db.info.dsn, autocommit=True) as other:
        holder = phases.start(other, "t", "k5", FP, now=at(60))
        assert holder.won
        holder.phase("create", insert_payment("k5"), now=at(61))
        # The zombie wakes: each of its writes is refused, its phase's own writes roll back.
        with pytest.raises(LeaseLost) as lost:
            zombie.phase("create", insert_payment("k5-zombie"), now=at(62))
        assert lost.value.token == zombie.token
        with pytest.raises(LeaseLost):
            zombie.call("charge", lambda idem: {"id": "zombie"}, now=at(62))
        with pytest.raises(LeaseLost):
            zombie.renew(now=at(62))
        with pytest.raises(LeaseLost):
            zombie.finish(Response(201, body=b"zombie"), now=at(62))
        with pytest.raises(LeaseLost):
            zombie.fail("woke up", now=at(62))
        assert holder.finish(ANSWER, now=at(63))
        with pytest.raises(LeaseLost):
            zombie.finish(Response(201, body=b"zombie"), now=at(64))
    assert count(db, "SELECT count(*) FROM payments WHERE key = 'k5-zombie'") == 0
    replay = phases.start(db, "t", "k5", FP, now=at(65))
    assert replay.replayed
    assert replay.response == ANSWER


def test_a_heartbeat_keeps_the_lease_and_a_takeover_waits_for_it(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    op = phases.start(db, "t", "k6", FP, now=at(0))
    op.renew(now=at(25))
    with psycopg.connect(db.info.dsn, autocommit=True) as other:
        assert phases.start(other, "t", "k6", FP, now=at(54)).in_flight
        assert phases.start(other, "t", "k6", FP, now=at(55)).won


def test_a_failure_ends_the_lease_so_the_retry_resumes_at_once(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    op = phases.start(db, "t", "k7", FP, now=at(0))

    def work(o: PhasedOperation[Any]) -> Response:
        o.phase("create", insert_payment("k7"), now=at(1))
        raise RuntimeError("provider down")

    with pytest.raises(RuntimeError):
        op.run(work, now=at(2))
    retry = phases.start(db, "t", "k7", FP, now=at(3))
    assert retry.won
    assert retry.point == "create"
    assert retry.last_error is not None
    assert "provider down" in retry.last_error
    # A 5xx answer is not stored: the key is handed on in the same way.
    assert retry.finish(Response(503), now=at(4)) is False
    third = phases.start(db, "t", "k7", FP, now=at(5))
    assert third.won
    assert third.attempts == 3


def test_the_completer_finishes_abandoned_requests_and_retires_failing_ones(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    def pay(o: PhasedOperation[Any]) -> Response:
        o.phase("create", insert_payment(o.key), now=at(100))
        charge = o.call("charge", lambda idem: {"id": "ch_" + o.args["n"]}, now=at(100))
        return Response(201, body=charge["id"].encode())

    def broken(o: PhasedOperation[Any]) -> Response:
        raise RuntimeError("always fails")

    for n in ("1", "2"):
        phases.start(db, "t", f"c{n}", FP, operation="pay", args={"n": n}, now=at(0))
    phases.start(db, "t", "c3", FP, operation="broken", args={}, now=at(0))
    phases.start(db, "t", "c4", FP, operation="unknown", args={}, now=at(0))
    operations = {"pay": pay, "broken": broken}
    # Nothing has expired at 10 s.
    done = phases.complete(db, operations, now=at(10))
    assert (done.finished, done.failed, done.retired) == (0, 0, 0)
    done = phases.complete(db, operations, now=at(40), retire_after=2)
    assert (done.finished, done.failed, done.retired) == (2, 1, 0)
    assert phases.start(db, "t", "c1", FP, now=at(41)).response == Response(201, body=b"ch_1")
    # Two holders of c3 failed (the client's, which died, and the completer's): retired.
    done = phases.complete(db, operations, now=at(42), retire_after=2)
    assert (done.finished, done.failed, done.retired) == (0, 0, 1)
    done = phases.complete(db, operations, now=at(43), retire_after=2)
    assert (done.finished, done.failed, done.retired) == (0, 0, 0)
    retired = phases.start(db, "t", "c3", FP, now=at(44))
    assert retired.replayed
    assert retired.response is not None
    assert retired.response.status == 500
    assert b"always fails" in retired.response.body
    # Too old for the completer: left alone (the health check shows it as stuck).
    done = phases.complete(db, operations, now=at(4000), max_age=timedelta(minutes=30))
    assert (done.finished, done.failed, done.retired) == (0, 0, 0)


def test_the_provider_key_is_deterministic_per_key_and_phase() -> None:
    assert provider_key("s", "k", "charge") == provider_key("s", "k", "charge")
    assert provider_key("s", "k", "charge") != provider_key("s", "k", "refund")
    assert provider_key("s", "ab", "c") != provider_key("s", "a", "bc")
    assert len(provider_key("s", "k" * 500, "charge")) == 47


def test_an_unjsonable_phase_result_is_refused_before_anything_commits(
    db: psycopg.Connection[Any], phases: PhaseStore
) -> None:
    op = phases.start(db, "t", "k8", FP, now=at(0))
    with pytest.raises(UsageError):
        op.phase("create", lambda conn: (1, 2), now=at(1))
    assert op.point is None


def test_a_connection_inside_a_transaction_is_refused(dsn: str, phases: PhaseStore) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(UsageError):
            phases.start(conn, "t", "k9", FP)


async def test_the_async_store_runs_the_same_phases(dsn: str) -> None:
    store = AsyncPhaseStore(lease=LEASE)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await store.start(conn, "t", "a1", FP, now=at(0))
        assert isinstance(op.claim, Won)

        async def create(c: psycopg.AsyncConnection[Any]) -> str:
            await c.execute("SELECT 1")
            return "made"

        async def charge(idem: str) -> str:
            return idem

        assert await op.phase("create", create, now=at(1)) == "made"
        assert await op.call("charge", charge, now=at(2)) == op.idempotency_key("charge")
        assert await op.finish(ANSWER, now=at(3))
        again = await store.start(conn, "t", "a1", FP, now=at(4))
        assert again.replayed
        assert again.response == ANSWER
