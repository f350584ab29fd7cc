"""A console action's form is small: a POST that declares or sends more than the console takes is
answered 413 at once, before the rest is read, instead of the whole body being awaited and held
in memory whatever its size."""

from __future__ import annotations

import base64
import socket
from urllib.parse import urlsplit

from tests.service.test_serve import TOKEN, Service, service  # noqa: F401

HUGE = 1024 * 1024 * 1024


def _post_head(url: str, path: str, length: int) -> bytes:
    auth = base64.b64encode(f"admin:{TOKEN}".encode()).decode()
    host = urlsplit(url).netloc
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Basic {auth}\r\n"
        f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _answer(url: str, request: bytes) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(request)
        # Only part of the declared body is ever sent: the answer must not wait for the rest.
        return conn.recv(4096)


def test_a_form_declared_too_large_is_refused_before_it_is_read(service: Service) -> None:  # noqa: F811
    for path in ("/admin/replay", "/admin/outbox/replay"):
        answer = _answer(service.url, _post_head(service.url, path, HUGE) + b"csrf=x&")
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])


def test_a_form_sent_too_large_is_refused_before_its_end(service: Service) -> None:  # noqa: F811
    head = _post_head(service.url, "/admin/replay", HUGE).replace(
        f"Content-Length: {HUGE}\r\n".encode(), b"Transfer-Encoding: chunked\r\n"
    )
    chunk = b"a" * (128 * 1024)
    answer = _answer(service.url, head + b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
