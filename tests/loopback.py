"""Loopback TCP servers that misbehave on purpose, for the tests of clients (the command line, the
conformance kit): an accept loop in a thread hands every connection to the test's function."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def loopback(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A server on 127.0.0.1 whose every connection goes to ``answer``, in a thread of its own
    (``answer`` owns the connection: it closes or keeps it); yields ``"127.0.0.1:PORT"``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
        listener.close()
        thread.join(timeout=5)


def close_unanswered(conn: socket.socket) -> None:
    """Read what comes first and close the connection without a word (a plain-HTTP port that
    drops what it cannot parse, a load balancer without a certificate)."""
    with conn:
        conn.recv(4096)


def read_head(conn: socket.socket) -> bytes | None:
    """Read until a request's head is whole: what came (the head, its blank line and any body
    bytes read with it), or None when the client went away first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data
