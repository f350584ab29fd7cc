"""A request that stays rate limited (429 Too Many Requests) partway through a check made the
check "not decided" and dropped the faults the check had already found: a server could escape a
failure by rate limiting what came after it. Such a check now fails on those faults, the rate
limiting said with them; one that found none is still not decided. And a --count-url answering
429 stopped the run at once with a usage error: it is now read again after its Retry-After, as
every other lone request, and said to be rate limited when it stays so."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.conformance.rate_limiting import (
    assert_judged,
    mismatch_endpoint,
    one_check,
    send,
    serve,
    slow_down,
)


@pytest.fixture
def runs_another_body() -> Iterator[str]:
    yield from mismatch_endpoint(refuses=False, retry=slow_down)


@pytest.fixture
def refuses_another_body() -> Iterator[str]:
    yield from mismatch_endpoint(refuses=True, retry=slow_down)


def mismatch_other_body(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    return one_check(["conformance", "http", url, "--only", "mismatch-other-body"], capsys)


def test_a_fault_found_before_the_rate_limiting_still_fails_the_check(
    runs_another_body: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = mismatch_other_body(runs_another_body, capsys)
    assert_judged(code, check, "FAIL", "; then POST ",
                  "was rate limited (429 Too Many Requests) after 3 waits for its Retry-After: "
                  "the rest of the check was not judged")  # fmt: skip
    evidence = check["evidence"]
    assert evidence.startswith("the other request answered 201, not 422"), check
    assert "the other request got the original's answer" not in evidence, check
    assert "not decided" not in evidence, check


def test_without_a_fault_before_it_the_rate_limiting_leaves_the_check_undecided(
    refuses_another_body: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = mismatch_other_body(refuses_another_body, capsys)
    assert_judged(code, check, "SKIP", "after 3 waits for its Retry-After")
    assert check["evidence"].startswith("not decided: POST "), check


def counted(limit: str) -> Iterator[str]:
    """An idempotent endpoint (one execution per key, the stored answer after) whose executions
    are counted at ``GET /count``, behind a limiter answering 429 to count reads: every other
    one with Retry-After: 1 (``limit`` "every other"), all of them with Retry-After: 1 ("all"),
    or all of them without a Retry-After ("all, no Retry-After")."""
    lock = threading.Lock()
    stored: dict[str, bytes] = {}
    reads = [0]

    def answer(conn: socket.socket, line: str, headers: dict[str, str], _: bytes) -> None:
        with lock:
            if line.startswith("GET /count"):
                reads[0] += 1
                if limit == "all, no Retry-After":
                    send(conn, "429 Too Many Requests", b"{}")
                elif limit == "all" or reads[0] % 2:
                    send(conn, "429 Too Many Requests", b"{}", "Retry-After: 1\r\n")
                else:
                    send(conn, "200 OK", json.dumps({"count": len(stored)}).encode())
                return
            key = headers.get("idempotency-key")
            if key is None:
                send(conn, "400 Bad Request", b"{}")
                return
            replayed = key in stored
            body = stored.setdefault(key, json.dumps({"id": uuid.uuid4().hex}).encode())
        send(conn, "201 Created", body, "Idempotent-Replayed: true\r\n" if replayed else "")

    yield from serve(answer)


@pytest.fixture
def count_limited_at_times() -> Iterator[str]:
    yield from counted("every other")


@pytest.fixture
def count_limited(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from counted(request.param)


def replay_identical(url: str) -> list[str]:
    return ["conformance", "http", url + "/payments", "--count-url", url + "/count",
            "--only", "replay-identical"]  # fmt: skip


def test_a_count_read_answered_429_is_read_again_after_its_retry_after(
    count_limited_at_times: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = one_check(replay_identical(count_limited_at_times), capsys)
    assert_judged(code, check, "PASS", "effects +1")


@pytest.mark.parametrize(
    ("count_limited", "how"),
    [("all", "after 3 waits for its Retry-After"),
     ("all, no Retry-After", "without a Retry-After")],
    indirect=["count_limited"],
)  # fmt: skip
def test_a_count_endpoint_that_stays_rate_limited_is_said_to_be(
    count_limited: str, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(replay_identical(count_limited))
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert err.startswith("pgonce: error: the count endpoint http://127.0.0.1:"), err
    assert f"/count is rate limited: it answered 429 Too Many Requests {how}" in err, err
    assert "exempt it from the rate limiting" in err, err
