"""Two relays against producers whose unordered events commit out of id order.

An unordered event can commit after a later event of its aggregate was claimed: it is then the
aggregate's oldest pending row, below a row another relay holds. The claim locks every row it
hands out and ends an aggregate's prefix before the first row it could not lock, so no row goes
to two relays, and no relay takes a row that follows one another relay holds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import psycopg

from pgonce.store._sync.outbox import OutboxStore, enqueue

WAIT = 10.0  # seconds: far beyond any step of these tests


def claim(conn: psycopg.Connection[tuple[object, ...]], per_aggregate: int = 10) -> list[int]:
    return [m.id for m in OutboxStore().claim(conn, limit=10, per_aggregate=per_aggregate)]


def test_a_relay_takes_no_row_after_one_another_relay_holds(dsn: str) -> None:
    """Relay 1 holds a late committed row but not the row after it; the row that commits below
    them makes a new head, and relay 2 takes that head alone: not the row after the held one."""
    with (
        psycopg.connect(dsn) as early,
        psycopg.connect(dsn) as late,
        psycopg.connect(dsn) as relay1,
        psycopg.connect(dsn) as relay2,
    ):
        first = enqueue(early, "audit", "u1", "a", {}, ordered=False)
        second = enqueue(late, "audit", "u1", "b", {}, ordered=False)
        third = enqueue(late, "audit", "u1", "c", {}, ordered=False)
        late.commit()
        assert claim(relay1, per_aggregate=1) == [second]
        early.commit()
        assert claim(relay2) == [first]
        assert OutboxStore().mark_published(relay2, [first]) == 1
        relay2.commit()
        assert OutboxStore().mark_published(relay1, [second]) == 1
        relay1.commit()
        assert claim(relay2) == [third]
        relay2.rollback()


@dataclass
class Shared:
    """What the threads of the concurrent test tell each other, under ``cond``."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    batches: list[tuple[int, list[int]]] = field(default_factory=list)
    claims: list[int] = field(default_factory=lambda: [0, 0])
    left: list[bool] = field(default_factory=lambda: [False, False])
    claimed: set[int] = field(default_factory=set)
    produced: list[int] = field(default_factory=list)
    stop: bool = False
    errors: list[BaseException] = field(default_factory=list)


def relay(dsn: str, me: int, shared: Shared) -> None:
    """Claim; hold the batch until the other relay has claimed since; mark it; commit. Until a
    claim that started after the producers finished comes back empty."""
    other = 1 - me
    try:
        with psycopg.connect(dsn) as conn:
            while True:
                with shared.cond:
                    # A claim that starts once the producers finished sees all their events.
                    last = shared.stop
                ids = claim(conn)
                with shared.cond:
                    shared.batches.append((me, ids))
                    shared.claimed.update(ids)
                    shared.claims[me] += 1
                    seen = shared.claims[other]
                    shared.cond.notify_all()

                    def other_moved(seen: int = seen) -> bool:
                        return shared.claims[other] > seen or shared.left[other] or shared.stop

                    shared.cond.wait_for(other_moved, timeout=WAIT)
                    finished = last and not ids
                if ids:
                    marked = OutboxStore().mark_published(conn, ids)
                    assert marked == len(ids), f"relay {me} was handed published rows: {ids}"
                conn.commit()
                if finished:
                    return
    except BaseException as exc:
        shared.errors.append(exc)
    finally:
        with shared.cond:
            shared.left[me] = True
            shared.cond.notify_all()


def produce(dsn: str, shared: Shared, rounds: int) -> None:
    """Per round and aggregate, an unordered event that commits after the next one of its
    aggregate was committed and claimed, with one more event behind that one."""
    try:
        with psycopg.connect(dsn) as early, psycopg.connect(dsn) as late:
            for number in range(rounds):
                aggregate = f"u{number % 3}"
                first = enqueue(early, "audit", aggregate, "a", {}, ordered=False)
                second = enqueue(late, "audit", aggregate, "b", {}, ordered=False)
                third = enqueue(late, "audit", aggregate, "c", {}, ordered=False)
                late.commit()
                with shared.cond:
                    shared.produced += [first, second, third]

                    def taken(second: int = second) -> bool:
                        return second in shared.claimed or all(shared.left)

                    assert shared.cond.wait_for(taken, timeout=WAIT), "the late event not claimed"
                early.commit()
    except BaseException as exc:
        shared.errors.append(exc)
    finally:
        with shared.cond:
            shared.stop = True
            shared.cond.notify_all()


def test_two_relays_never_hand_out_one_row_while_unordered_events_commit_late(dsn: str) -> None:
    shared = Shared()
    threads = [threading.Thread(target=relay, args=(dsn, me, shared)) for me in (0, 1)]
    threads.append(threading.Thread(target=produce, args=(dsn, shared, 60)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert shared.errors == []
    handed = [i for _, ids in shared.batches for i in ids]
    twice = sorted({i for i in handed if handed.count(i) > 1})
    assert twice == []
    assert sorted(handed) == sorted(shared.produced)
    with psycopg.connect(dsn) as conn:
        assert OutboxStore().counts(conn).pending == 0
