"""A check that outlives the run's budget (a server that trickles one check's answers) says it
was cut off by --budget, with the time it had: it read "no verdict within the time budget
(N s)", N being what was left, not the --budget given, and named no option."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, read_headers


@pytest.fixture
def trickling_later() -> Iterator[str]:
    """Answers the first request at once, then trickles every answer a byte at a time."""
    stop = threading.Event()
    lock = threading.Lock()
    seen = [0]

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                if read_headers(conn) is None:
                    return
                with lock:
                    seen[0] += 1
                    first = seen[0] == 1
                if first:
                    conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
                    return
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n")
                while not stop.wait(0.2):
                    conn.sendall(b"1\r\n1\r\n")
            except OSError:
                pass

    with loopback(answer) as address:
        yield f"http://{address}/payments"
        stop.set()


def test_a_check_cut_off_by_the_budget_names_it(
    trickling_later: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["conformance", "http", trickling_later, "--budget", "2", "--json",
                 "--only", "key-required", "--only", "key-empty"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, err
    first, second = json.loads(out)["checks"]
    assert first["verdict"] == "FAIL"
    assert first["evidence"].startswith("no verdict within the "), first
    assert first["evidence"].endswith(" s left of the run's time budget (--budget)"), first
    assert second["evidence"] == "not run: the time budget ran out"
