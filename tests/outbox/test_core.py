"""The relay's pure decisions: backoff, parking, and settling a batch per aggregate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pgonce.core.outbox import OutboxMessage, RetryPolicy, refuse, settle, validate_event
from pgonce.errors import ConfigError, UsageError

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def msg(id: int, aggregate: str = "a", attempts: int = 0) -> OutboxMessage:
    return OutboxMessage(id, "order", aggregate, "order.created", "{}", {}, NOW, attempts)


def test_backoff_doubles_from_base_up_to_the_cap() -> None:
    policy = RetryPolicy(base=timedelta(seconds=1), cap=timedelta(seconds=10), jitter=0.2)
    delays = [policy.delay(n, rand=0.5) for n in range(1, 7)]
    assert delays == [timedelta(seconds=s) for s in (1, 2, 4, 8, 10, 10)]
    assert policy.delay(1, rand=0.0) == timedelta(seconds=0.8)
    assert policy.delay(3, rand=0.999) < timedelta(seconds=4.8)
    assert policy.delay(10_000, rand=0.5) == timedelta(seconds=10)


def test_a_refusal_schedules_the_next_attempt_until_the_last_one_parks() -> None:
    policy = RetryPolicy(max_attempts=3, base=timedelta(seconds=2), jitter=0.0)
    first = refuse(policy, id=7, attempts_before=0, error="nack", now=NOW)
    assert (first.attempts, first.next_attempt_at, first.parked_at) == (
        1,
        NOW + timedelta(seconds=2),
        None,
    )
    second = refuse(policy, id=7, attempts_before=1, error="nack", now=NOW)
    assert second.next_attempt_at == NOW + timedelta(seconds=4)
    last = refuse(policy, id=7, attempts_before=2, error="x" * 5000, now=NOW)
    assert last.parked_at == NOW
    assert last.attempts == 3
    assert len(last.last_error) == 1000


def test_a_refusals_error_is_text_the_database_can_store() -> None:
    """A broker's or a peer's message may carry a NUL or a lone surrogate: the write recording
    the refusal would fail, and the relay would retry the batch for ever."""
    refusal = refuse(RetryPolicy(), id=7, attempts_before=0, error="bad\x00 \udc80 é", now=NOW)
    assert refusal.last_error == "bad? ? é"


def test_policy_refuses_settings_that_cannot_work() -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ConfigError):
        RetryPolicy(base=timedelta(seconds=5), cap=timedelta(seconds=1))
    with pytest.raises(ConfigError):
        RetryPolicy(jitter=1.5)


def test_settle_records_only_the_first_refusal_of_an_aggregate() -> None:
    batch = [msg(1, "a"), msg(2, "b"), msg(3, "a"), msg(4, "b"), msg(5, "a"), msg(6, "c")]
    result = settle(batch, acked={1, 2, 5}, refused={3: "nack", 4: "nack", 6: "nack"})
    assert result.published == [1, 2, 5]
    # 3 is a's first failure; 5 was acknowledged behind it (out of order, counted); 4 is b's
    # first failure; 6 is c's.
    assert [(m.id, e) for m, e in result.refused] == [(3, "nack"), (4, "nack"), (6, "nack")]
    assert result.out_of_order == 1
    assert result.unsettled == []


def test_settle_leaves_unanswered_rows_unsettled_and_blocks_their_aggregate() -> None:
    batch = [msg(1, "a"), msg(2, "a"), msg(3, "b")]
    result = settle(batch, acked={3}, refused={2: "nack"})
    # 1 has no answer (lost); 2's refusal is not its own fault: it waited behind 1.
    assert result.unsettled == [1, 2]
    assert result.refused == []
    assert result.published == [3]


@pytest.mark.parametrize(
    ("aggregatetype", "aggregateid", "type"),
    [("", "1", "t"), ("o", "", "t"), ("o", "1", ""), ("o" * 256, "1", "t"), ("o\x00", "1", "t")],
)
def test_event_names_are_validated(aggregatetype: str, aggregateid: str, type: str) -> None:
    with pytest.raises(UsageError):
        validate_event(aggregatetype, aggregateid, type)


def test_a_late_refusal_of_a_long_policy_waits_the_cap_instead_of_overflowing() -> None:
    # An hour's base doubled 35 times passes timedelta's limit: the relay computing it died.
    policy = RetryPolicy(max_attempts=100, base=timedelta(hours=1), cap=timedelta(hours=6))
    assert policy.delay(36) == policy.delay(99) == timedelta(hours=6)
    refusal = refuse(policy, id=1, attempts_before=60, error="refused", now=NOW)
    wait = refusal.next_attempt_at - NOW
    assert (
        timedelta(hours=6) * (1 - policy.jitter) <= wait <= timedelta(hours=6) * (1 + policy.jitter)
    )
