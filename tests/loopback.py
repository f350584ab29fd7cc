"""Loopback TCP servers that misbehave on purpose, for the tests of clients (the command line, the
conformance kit): an accept loop in a thread hands every connection to the test's function. The
reads here serve those functions, and the tests that talk to a server over a raw socket."""

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


def read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """Read one request whole, its head and the body its Content-Length announces: ``(head,
    body)``, the head without its blank line, or None when the client went away first."""
    data = read_head(conn)
    if data is None:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head, body


def parse_head(data: bytes) -> tuple[str, dict[str, str], bytes]:
    """What :func:`read_head` read, parsed: the request line, the header fields (names
    lower-cased, values stripped) and the body bytes that came with the head."""
    head, _, body = data.partition(b"\r\n\r\n")
    line, *fields = head.decode("latin-1").split("\r\n")
    headers = {}
    for field in fields:
        name, _, value = field.partition(":")
        headers[name.strip().lower()] = value.strip()
    return line, headers, body


def read_fields(conn: socket.socket) -> tuple[str, dict[str, str], bytes] | None:
    """:func:`read_request`, parsed: the request line, the header fields (as
    :func:`parse_head`) and the whole body, or None when the client went away first."""
    read = read_request(conn)
    if read is None:
        return None
    head, body = read
    line, headers, _ = parse_head(head)
    return line, headers, body


def read_headers(conn: socket.socket) -> dict[str, str] | None:
    """Read one request whole: its header fields (as :func:`parse_head`), or None when the
    client went away first."""
    read = read_fields(conn)
    return None if read is None else read[1]


def read_to_close(conn: socket.socket) -> bytes:
    """Read all the peer sends until it closes its side of the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data
