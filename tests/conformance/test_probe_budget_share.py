"""One check that waits long (a server trickling the answer to one kind of request) no longer
takes the whole --budget: each check gets a share of what is left, so the slow one fails alone,
saying which limit ran out, and the checks after it still run; the run stays within --budget."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from pgonce.conformance.runner import REQUEST_TIMEOUT
from tests.loopback import loopback, read_headers

PROBLEM = b'{"title":"bad key"}'


@pytest.fixture
def slow_without_key() -> Iterator[str]:
    """Refuses a bad key with a 400 problem and accepts a good one at once, but trickles its
    answer to a request without a key a byte at a time, for as long as the client reads."""
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                headers = read_headers(conn)
                if headers is None:
                    return
                key = headers.get("idempotency-key")
                if key is None:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while not stop.wait(0.2):
                        conn.sendall(b"1\r\n1\r\n")
                elif key.startswith('"conformance-'):
                    conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
                else:
                    conn.sendall(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/problem+json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(PROBLEM), PROBLEM)
                    )
            except OSError:
                pass

    with loopback(answer) as address:
        yield f"http://{address}/payments"
        stop.set()


def test_a_slow_check_fails_alone_and_the_checks_after_it_run(
    slow_without_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = 3 * (REQUEST_TIMEOUT + 1)
    started = time.monotonic()
    code = main(["conformance", "http", slow_without_key, "--budget", str(budget), "--json",
                 "--only", "key-required", "--only", "key-empty",
                 "--only", "key-control-characters"])  # fmt: skip
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1, err
    slow, empty, control = json.loads(out)["checks"]
    assert slow["verdict"] == "FAIL", slow
    assert slow["evidence"].startswith("no verdict within its "), slow
    assert "share of the run's time budget (--budget)" in slow["evidence"], slow
    assert empty["verdict"] == "PASS", empty
    assert control["verdict"] == "PASS", control
    assert took < budget
