"""The framework-neutral decisions of pgonce.http.semantics, without a server or a database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from pgonce.core.outcomes import InFlight, Replay, Response
from pgonce.errors import InvalidIdempotencyKey
from pgonce.http import semantics
from pgonce.http.semantics import IdempotencyRules


def test_a_body_over_the_limit_is_dropped_and_only_its_size_kept() -> None:
    captured = IdempotencyRules(max_response_bytes=10).capture()
    captured.status = 201
    captured.add(b"12345", more=True)
    captured.add(b"678901", more=True)
    captured.add(b"", more=False)
    assert captured.too_large
    assert captured.body == []
    assert not captured.answered
    assert not captured.keep(began=True, status_kept=lambda status: True)


def test_chunks_after_the_last_one_are_ignored() -> None:
    captured = IdempotencyRules().capture()
    captured.status = 200
    captured.add(b"done", more=False)
    captured.add(b"late", more=False)
    assert captured.response().body == b"done"


@pytest.mark.parametrize(
    ("began", "status", "stored"),
    [(True, 201, True), (False, 201, False), (True, 503, False), (True, 400, True)],
)
def test_what_is_stored(began: bool, status: int, stored: bool) -> None:
    captured = IdempotencyRules().capture()
    captured.status = status
    captured.add(b"{}", more=False)
    assert captured.keep(began=began, status_kept=lambda s: s is not None and s < 500) is stored


def test_declared_length_over_the_limit() -> None:
    rules = IdempotencyRules(max_request_bytes=100)
    assert rules.declared_too_large(b"101")
    assert rules.declared_too_large("101")
    assert not rules.declared_too_large(b"100")
    assert not rules.declared_too_large(None)
    assert not rules.declared_too_large(b"12x")  # not a number: the bytes read decide
    assert not rules.declared_too_large("1²")  # a digit to str.isdigit(), not to int()
    body = json.loads(rules.request_too_large.body)
    assert body["status"] == 413
    assert "100 bytes" in body["detail"]


def test_replay_answer_marks_the_replay_and_drops_the_cookie() -> None:
    claimed = datetime(2030, 1, 1, tzinfo=UTC)
    stored = Response(201, (("location", "/p/1"), ("set-cookie", "s=1")), b"{}")
    answer = IdempotencyRules(retention=timedelta(hours=1)).replay(
        Replay(stored, claimed_at=claimed, completed_at=claimed)
    )
    headers = dict(answer.headers)
    assert answer.status == 201
    assert answer.body == b"{}"
    assert headers[b"idempotent-replayed"] == b"true"
    assert headers[b"idempotency-key-expires"] == b"Tue, 01 Jan 2030 01:00:00 GMT"
    assert b"set-cookie" not in headers


def test_problem_answers() -> None:
    in_flight = semantics.in_flight(InFlight(retry_after=3, reason="locked"))
    assert in_flight.status == 409
    assert (b"retry-after", b"3") in in_flight.headers
    with pytest.raises(InvalidIdempotencyKey) as caught:
        IdempotencyRules.key([b"a", b"b"])
    assert semantics.invalid_key(caught.value).status == 400
    assert semantics.unavailable(2).status == 503
    assert semantics.RESPONSE_TOO_LARGE.status == 500
    assert semantics.MISSING_KEY.status == 400


def test_a_duplicates_wait_for_a_two_phase_holder_doubles_its_pauses_up_to_the_bound() -> None:
    now = [100.0]
    waiting = semantics.HolderWait(timedelta(seconds=1), lambda: now[0])
    pauses = []
    while (pause := waiting.pause()) is not None:
        pauses.append(pause)
        now[0] += pause + 0.005  # each look takes 5 ms
    assert pauses[:5] == [0.02, 0.04, 0.08, 0.16, 0.25]
    assert max(pauses) == semantics.LONGEST_LOOK
    assert 1.0 <= sum(pauses) + 0.005 * len(pauses) < 1.0 + 0.005 + 1e-9  # ends at the deadline
    assert semantics.HolderWait(None, lambda: now[0]).pause() is None  # no wait: 409 at once
