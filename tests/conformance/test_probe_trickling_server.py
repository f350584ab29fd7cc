"""A server (or a count endpoint) that trickles its answer a byte at a time resets httpx's
timeouts at every byte: the kit's first request and first count read waited for it for ever,
past --budget. They now end within the budget (or the request timeout and a second, if longer),
with one line saying what did not answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pgonce.conformance.runner import REQUEST_TIMEOUT
from tests.conformance.conftest import ALICE, PAYMENT
from tests.http.conftest import Server
from tests.loopback import loopback, read_request
from tests.test_cli import ROOT

BUDGET = 3.0


@pytest.fixture
def trickling() -> Iterator[str]:
    """A loopback server answering 200 and then one byte of body every half second, never done."""
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            if read_request(conn) is None:
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while not stop.wait(0.5):
                try:
                    conn.sendall(b"1\r\n1\r\n")
                except OSError:
                    return

    with loopback(answer) as address:
        yield f"http://{address}"
        stop.set()


def conformance(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "conformance", *args, "--budget", str(BUDGET)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUDGET + 60,
        env={**os.environ, "TRICKLE_SECRET": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"},
        check=False,
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize(
    "args",
    [("http",), ("webhooks", "--scheme", "stripe", "--secret", "env:TRICKLE_SECRET")],
)
def test_a_trickled_answer_ends_within_the_budget(trickling: str, args: tuple[str, ...]) -> None:
    result, took = conformance(args[0], trickling + "/endpoint", *args[1:])
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"pgonce: error: cannot reach {trickling}/endpoint: no complete answer within "
        f"{REQUEST_TIMEOUT + 1:.1f} s\n"
    )
    assert took < REQUEST_TIMEOUT + 15


def test_a_trickled_count_ends_within_the_budget(test_app: Server, trickling: str) -> None:
    result, took = conformance(
        "http", test_app.url + "/payments", "--body", PAYMENT.decode(),
        "--header", f"Authorization: {ALICE['Authorization']}", "--count-url", trickling + "/n",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("pgonce: error: cannot read the effect count: no complete")
    assert took < REQUEST_TIMEOUT + 15
