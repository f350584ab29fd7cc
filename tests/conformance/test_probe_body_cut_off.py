"""A server that refuses a body too large by closing the connection (RFC 9110 §15.5.14: "the
server MAY close the connection"; Go's server and proxies stop reading and reset it, under their
own 413) failed the 413 checks with "no answer", as if it had buffered the body or crashed."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, parse_head, read_head

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
LIMIT = 64 * 1024


def bounded(conn: socket.socket) -> None:
    """Reads the head; over LIMIT, resets the connection unread; else answers 201 (or 400 to
    a request without a key)."""
    with conn:
        try:
            read = read_head(conn)
            if read is None:
                return
            _, headers, body = parse_head(read)
            length = int(headers.get("content-length", "0"))
            if length > LIMIT:
                # Closed with unread data: a reset, whatever was written before it.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            status = b"201 Created" if "idempotency-key" in headers else b"400 Bad Request"
            conn.sendall(
                b"HTTP/1.1 %s\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}" % status
            )
        except OSError:
            pass


@pytest.fixture
def server() -> Iterator[str]:
    with loopback(bounded) as address:
        yield f"http://{address}"


@pytest.mark.parametrize(
    ("kind", "path", "check", "rest"),
    [
        ("http", "/payments", "body-too-large-413", []),
        ("webhooks", "/webhooks/shop", "oversized-body-413",
         ["--scheme", "standard-webhooks", "--secret", "env:CUT_SECRET"]),
    ],
)  # fmt: skip
def test_a_connection_closed_on_a_body_too_large_is_a_refusal(
    server: str,
    kind: str,
    path: str,
    check: str,
    rest: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUT_SECRET", SECRET)
    code = main(
        ["conformance", kind, server + path, *rest, "--only", check, "--json",
         "--max-body-bytes", str(LIMIT)]
    )  # fmt: skip
    out, err = capsys.readouterr()
    (result,) = json.loads(out)["checks"]
    assert result["verdict"] == "PASS", result
    assert "the server closed the connection instead of reading it all" in result["evidence"]
    assert "RFC 9110 §15.5.14 allows" in result["evidence"]
    assert code == 0, err
