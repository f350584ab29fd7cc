"""A correct endpoint behind a rate limiter answers part of a burst 429 Too Many Requests: a 429
means the copy was not executed, so concurrent-once neither counts it as an execution nor as a
wrong answer. It failed such a server with "answers other than 2xx or 409: N× 429" although
nothing ran twice; when too few copies get past the limiter for a race, the check is not
decided, and says that the rate limiting is why."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.conformance.rate_limiting import Window, assert_judged, one_check, send, serve, slow_down


def limited_endpoint(allowed: int) -> Iterator[str]:
    """An idempotent endpoint (one execution per key, a 409 while it runs, the stored answer
    after) behind a limiter letting ``allowed`` requests a second through and answering the
    rest 429 with Retry-After: 1; its executions are counted at ``GET /count`` (not limited)."""
    lock = threading.Lock()
    stored: dict[str, bytes | None] = {}
    executed = [0]
    window = Window(allowed)

    def answer(conn: socket.socket, line: str, headers: dict[str, str], _: bytes) -> None:
        if line.startswith("GET /count "):
            send(conn, "200 OK", json.dumps({"count": executed[0]}).encode())
            return
        with lock:
            if window.refuses():
                slow_down(conn)
                return
            key = headers.get("idempotency-key")
            if key is None:
                send(conn, "400 Bad Request", b"{}")
                return
            if key in stored:
                done = stored[key]
                if done is None:
                    busy = "Retry-After: 1\r\nContent-Type: application/problem+json\r\n"
                    send(conn, "409 Conflict", b'{"title":"in flight"}', busy)
                else:
                    send(conn, "201 Created", done, "Idempotent-Replayed: true\r\n")
                return
            stored[key] = None
        time.sleep(0.2)  # the work, with the key claimed
        with lock:
            executed[0] += 1
            stored[key] = json.dumps({"id": uuid.uuid4().hex}).encode()
            send(conn, "201 Created", stored[key] or b"")

    yield from serve(answer)


@pytest.fixture
def limiter() -> Iterator[str]:
    yield from limited_endpoint(allowed=10)


@pytest.fixture
def strict_limiter() -> Iterator[str]:
    yield from limited_endpoint(allowed=1)


def http_check(
    url: str, name: str, capsys: pytest.CaptureFixture[str], *more: str
) -> tuple[int, dict[str, str]]:
    return one_check(["conformance", "http", url + "/payments", "--count-url", url + "/count",
                      "--only", name, *more], capsys)  # fmt: skip


def test_copies_a_rate_limiter_refused_are_neither_executions_nor_faults(
    limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = http_check(limiter, "concurrent-once", capsys, "--concurrency", "30")
    assert_judged(code, check, "PASS", "429", "rate limit", "effects +1")


def test_too_few_copies_past_the_limiter_is_no_verdict_and_names_it(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = http_check(strict_limiter, "concurrent-once", capsys, "--concurrency", "30")
    assert_judged(code, check, "SKIP", "not decided", "rate limit")


def test_a_request_the_limiter_refused_is_sent_again_after_its_retry_after(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # One request a second: the original's retry, sent at once, is refused 429 with
    # Retry-After: 1; sent again a second later, it is the replay the check judges.
    code, check = http_check(strict_limiter, "replay-identical", capsys)
    assert_judged(code, check, "PASS", "effects +1")
