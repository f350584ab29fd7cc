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

from pgonce.cli import main
from tests.loopback import loopback, read_fields


def send(conn: socket.socket, status: str, body: bytes, extra: str = "") -> None:
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n".encode()
        + body
    )


def limited_endpoint(allowed: int) -> Iterator[str]:
    """An idempotent endpoint (one execution per key, a 409 while it runs, the stored answer
    after) behind a limiter letting ``allowed`` requests a second through and answering the
    rest 429 with Retry-After: 1; its executions are counted at ``GET /count`` (not limited)."""
    lock = threading.Lock()
    stored: dict[str, bytes | None] = {}
    executed = [0]
    window = [time.monotonic(), 0]

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                read = read_fields(conn)
                if read is None:
                    return
                line, headers, _ = read
                if line.startswith("GET /count "):
                    send(conn, "200 OK", json.dumps({"count": executed[0]}).encode())
                    return
                with lock:
                    now = time.monotonic()
                    if now - window[0] >= 1.0:
                        window[:] = [now, 0]
                    window[1] += 1
                    if window[1] > allowed:
                        send(conn, "429 Too Many Requests", b'{"title":"slow down"}',
                             "Retry-After: 1\r\n")  # fmt: skip
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
            except OSError:
                pass

    with loopback(answer) as address:
        yield f"http://{address}"


@pytest.fixture
def limiter() -> Iterator[str]:
    yield from limited_endpoint(allowed=10)


@pytest.fixture
def strict_limiter() -> Iterator[str]:
    yield from limited_endpoint(allowed=1)


def concurrent_once(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    code = main(["conformance", "http", url + "/payments", "--count-url", url + "/count",
                 "--only", "concurrent-once", "--concurrency", "30", "--json"])  # fmt: skip
    out, _ = capsys.readouterr()
    (check,) = json.loads(out)["checks"]
    return code, check


def test_copies_a_rate_limiter_refused_are_neither_executions_nor_faults(
    limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = concurrent_once(limiter, capsys)
    assert check["verdict"] == "PASS", check
    assert code == 0
    assert "429" in check["evidence"], check
    assert "rate limit" in check["evidence"], check
    assert "effects +1" in check["evidence"], check


def test_too_few_copies_past_the_limiter_is_no_verdict_and_names_it(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = concurrent_once(strict_limiter, capsys)
    assert check["verdict"] == "SKIP", check
    assert code == 0
    assert "not decided" in check["evidence"], check
    assert "rate limit" in check["evidence"], check


def test_a_request_the_limiter_refused_is_sent_again_after_its_retry_after(
    strict_limiter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # One request a second: the original's retry, sent at once, is refused 429 with
    # Retry-After: 1; sent again a second later, it is the replay the check judges.
    code = main(["conformance", "http", strict_limiter + "/payments",
                 "--count-url", strict_limiter + "/count", "--only", "replay-identical",
                 "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    (check,) = json.loads(out)["checks"]
    assert check["verdict"] == "PASS", check
    assert code == 0, err
    assert "effects +1" in check["evidence"], check
