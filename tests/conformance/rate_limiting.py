"""What the tests of the conformance kit under rate limiting (429 Too Many Requests) share:
loopback endpoints answering one request a connection, the limiter's window, and one check run
from the command line with its verdict read back."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, read_fields

#: A request handler: the connection, the request line, the header fields (names lower-cased)
#: and the whole body.
Handler = Callable[[socket.socket, str, dict[str, str], bytes], None]


def send(
    conn: socket.socket, status: str, body: bytes, extra: str = "", media: str = "application/json"
) -> None:
    """Answer with ``body`` and the header lines ``extra`` (each ending in CRLF)."""
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: {media}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n".encode()
        + body
    )


def slow_down(conn: socket.socket) -> None:
    """The limiter's answer: 429, to be sent again after a second."""
    send(conn, "429 Too Many Requests", b'{"title":"slow down"}', "Retry-After: 1\r\n")


class Window:
    """A limiter letting ``allowed`` requests a second through; its caller holds a lock."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed
        self.started = time.monotonic()
        self.taken = 0

    def refuses(self) -> bool:
        """Count a request in the current second; True when it is past the ``allowed``."""
        now = time.monotonic()
        if now - self.started >= 1.0:
            self.started, self.taken = now, 0
        self.taken += 1
        return self.taken > self.allowed


def serve(handle: Handler, path: str = "") -> Iterator[str]:
    """A loopback endpoint handing each request, read whole, to ``handle``, the connection
    closed after it (a client that went away is no failure); yields its URL, ``path`` after the
    address. For fixtures: ``yield from serve(...)``."""

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                read = read_fields(conn)
                if read is not None:
                    handle(conn, *read)
            except OSError:
                pass

    with loopback(answer) as address:
        yield f"http://{address}{path}"


def one_check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    """Run ``pgonce`` with ``argv`` (a run of one check) and ``--json``: its exit code and the
    check's result."""
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert out, err
    (check,) = json.loads(out)["checks"]
    return code, check


def assert_judged(code: int, check: dict[str, str], verdict: str, *evidence: str) -> None:
    """The check has ``verdict``, the run the exit code that goes with it (1 for a failure, 0
    for a pass or no verdict), and its evidence says each of ``evidence``."""
    assert check["verdict"] == verdict, check
    assert code == (1 if verdict == "FAIL" else 0), check
    for part in evidence:
        assert part in check["evidence"], check


def mismatch_endpoint(refuses: bool, retry: Callable[[socket.socket], None]) -> Iterator[str]:
    """An endpoint for ``mismatch-other-body``: runs a new key's request (201, a new id); the same
    key with another body is run again (201, another id: the fault) or, when it ``refuses``,
    refused with a 422 problem; the same key with the original's body, the retry after it, is
    handed to ``retry``. For fixtures: ``yield from mismatch_endpoint(...)``."""
    lock = threading.Lock()
    originals: dict[str, bytes] = {}

    def answer(conn: socket.socket, _: str, headers: dict[str, str], body: bytes) -> None:
        key = headers.get("idempotency-key")
        if key is None:
            send(conn, "400 Bad Request", b"{}")
            return
        with lock:
            new = key not in originals
            original = originals.setdefault(key, body)
        if new or (original != body and not refuses):
            send(conn, "201 Created", json.dumps({"id": uuid.uuid4().hex}).encode())
        elif original != body:
            problem = b'{"title":"another request with this key"}'
            send(conn, "422 Unprocessable Content", problem, media="application/problem+json")
        else:
            retry(conn)

    yield from serve(answer, "/payments")
