"""A correct receiver behind a rate limiter answers part of a retry storm 429 Too Many Requests:
a 429 says the delivery was not taken (the provider sends it again later), so the storm check
counts it neither as an acknowledgement nor as a fault. It failed such a receiver with "not every
copy was acknowledged" although the event had exactly one effect; when too few copies get past
the limiter for a storm, the check is not decided, and says that the rate limiting is why. A lone
delivery answered 429 is sent again after its Retry-After, as a provider does, instead of
failing the check with the limiter's answer."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.conformance import rate_limiting
from tests.conformance.rate_limiting import Window, assert_judged, send, serve, slow_down

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def limited_receiver(allowed: int, duplicates: str = "200 OK") -> Iterator[str]:
    """A receiver handling each event id once (200 for the first copy it takes, ``duplicates``
    for each one after it, a 409 problem for the id with another body) behind a limiter letting
    ``allowed`` deliveries a second through and answering the rest 429 with Retry-After: 1; the
    events it handled are counted at ``GET /count`` (not limited)."""
    lock = threading.Lock()
    handled: dict[str, bytes] = {}
    window = Window(allowed)

    def answer(conn: socket.socket, line: str, _: dict[str, str], body: bytes) -> None:
        if line.startswith("GET /count "):
            with lock:
                count = len(handled)
            send(conn, "200 OK", json.dumps({"count": count}).encode())
            return
        if not line.startswith("POST "):
            send(conn, "204 No Content", b"")
            return
        with lock:
            if window.refuses():
                slow_down(conn)
                return
            event_id = json.loads(body)["id"]
            seen = event_id in handled
            known = handled.setdefault(event_id, body)
        if seen and known == body:
            send(conn, duplicates, b"{}")
            return
        if known != body:
            send(conn, "409 Conflict", b'{"title":"another body for this id"}',
                 media="application/problem+json")  # fmt: skip
            return
        send(conn, "200 OK", b"{}")

    yield from serve(answer)


@pytest.fixture
def limiter() -> Iterator[str]:
    yield from limited_receiver(allowed=8)


@pytest.fixture
def strict_limiter() -> Iterator[str]:
    yield from limited_receiver(allowed=1)


@pytest.fixture
def strict_failing_limiter() -> Iterator[str]:
    yield from limited_receiver(allowed=1, duplicates="500 Internal Server Error")


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIMITED_SECRET", SECRET)


def one_check(
    url: str, capsys: pytest.CaptureFixture[str], name: str = "retry-storm-one-effect"
) -> tuple[int, dict[str, str]]:
    return rate_limiting.one_check(["conformance", "webhooks", url + "/webhooks/shop", "--scheme",
                                    "standard-webhooks", "--secret", "env:LIMITED_SECRET",
                                    "--count-url", url + "/count", "--only", name],
                                   capsys)  # fmt: skip


def test_copies_a_rate_limiter_refused_are_neither_acknowledgements_nor_faults(
    limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = one_check(limiter, capsys)
    assert_judged(code, check, "PASS", "× 429", "rate limited (429 Too Many Requests)",
                  "effects +1")  # fmt: skip


def test_too_few_copies_past_the_limiter_is_no_verdict_and_names_it(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = one_check(strict_limiter, capsys)
    assert_judged(code, check, "SKIP", "rate limit")
    assert check["evidence"].startswith("not decided: only 1 of 20 copies got past"), check


def test_a_lone_delivery_answered_429_is_sent_again_after_its_retry_after(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # One delivery a second: the other body, sent at once after the original, is refused 429
    # with Retry-After: 1; sent again a second later, its 409 is what the check judges.
    code, check = one_check(strict_limiter, capsys, "same-id-other-body-409")
    assert_judged(code, check, "PASS", "same id, other body: 409 application/problem+json",
                  "effects +1")  # fmt: skip


def test_a_fault_past_the_limiter_fails_the_storm_though_too_few_got_past(
    strict_failing_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # One copy a second gets past: the first is acknowledged, each one after it answered 500.
    code, check = one_check(strict_failing_limiter, capsys)
    assert_judged(code, check, "FAIL", "answered 5xx, a server failure)")
    evidence = check["evidence"]
    assert evidence.startswith("not every copy past the rate limiting was acknowledged ("), check
    assert "not decided" not in evidence, check
