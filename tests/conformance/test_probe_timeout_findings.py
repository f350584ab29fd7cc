"""A check that ran out of its time (its share of --budget, or the budget itself) failed with
"no verdict within ..." alone, and dropped the faults it had already found: the verdict was right,
but the evidence lost why. Such a check now fails on those faults, the time-out said after them;
one that found none fails with the time-out line alone, as before."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.conformance.rate_limiting import mismatch_endpoint, one_check, send

BUDGET = "2"


def endpoint(refuses: bool, retry: str = "trickle") -> Iterator[str]:
    """``mismatch-other-body``'s endpoint whose retry (the same key with the original's body) is
    answered 200 and then a byte of body at a time, never done (``retry="trickle"``), not at all:
    the connection closed (``"close"``), or 200 with a body over the kit's 4 MiB (``"huge"``)."""
    stop = threading.Event()

    def answer_retry(conn: socket.socket) -> None:
        if retry == "close":
            return
        if retry == "huge":
            send(conn, "200 OK", b"[" + b"0," * (5 << 19) + b"0]")
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not stop.wait(0.2):
            conn.sendall(b"1\r\n1\r\n")

    try:
        yield from mismatch_endpoint(refuses, answer_retry)
    finally:
        stop.set()


@pytest.fixture
def runs_another_body() -> Iterator[str]:
    yield from endpoint(refuses=False)


@pytest.fixture
def refuses_another_body() -> Iterator[str]:
    yield from endpoint(refuses=True)


def mismatch_other_body(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    argv = ["conformance", "http", url, "--only", "mismatch-other-body", "--budget", BUDGET]
    return one_check(argv, capsys)


def test_a_fault_found_before_the_time_ran_out_is_in_the_evidence(
    runs_another_body: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = mismatch_other_body(runs_another_body, capsys)
    assert check["verdict"] == "FAIL", check
    assert code == 1
    fault, timed_out, *seen = check["evidence"].split("; ")
    assert fault == "the other request answered 201, not 422", check
    assert timed_out.startswith("then no verdict within the "), check
    assert timed_out.endswith(
        " s left of the run's time budget (--budget): the rest of the check was not judged"
    ), check
    # What the check saw comes after its faults, as in any failure; the retry's answer never
    # came whole, so nothing was judged of it.
    (shown,) = seen
    assert shown.startswith("the other request: 201 application/json "), check


def test_without_a_fault_before_it_the_time_out_alone_is_the_evidence(
    refuses_another_body: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, check = mismatch_other_body(refuses_another_body, capsys)
    assert check["verdict"] == "FAIL", check
    assert code == 1
    evidence = check["evidence"]
    assert evidence.startswith("no verdict within the "), check
    assert evidence.endswith(" s left of the run's time budget (--budget)"), check


@pytest.mark.parametrize(
    ("retry", "cut"),
    [
        ("close", "then no complete answer to POST http://"),
        ("huge", "then POST http://"),
    ],
)
def test_a_fault_found_before_a_request_failed_is_in_the_evidence(
    retry: str, cut: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same for a retry that got no complete answer, or one too large to read: the check
    fails on the fault it had found, then on the request that failed."""
    for url in endpoint(refuses=False, retry=retry):
        code, check = mismatch_other_body(url, capsys)
    assert check["verdict"] == "FAIL", check
    assert code == 1
    evidence = check["evidence"]
    assert evidence.startswith(f"the other request answered 201, not 422; {cut}"), check
    assert ": the rest of the check was not judged" in evidence, check
