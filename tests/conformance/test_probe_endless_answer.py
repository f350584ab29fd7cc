"""A server that streams an endless (or huge) body fast was read into memory until the run's
--budget ran out: httpx's read timeout starts again at every byte, and nothing capped the size of
an answer. The kit now reads at most MAX_ANSWER_BYTES of one answer and says so in the check's
finding, for every request it sends (one shared send function)."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from pgonce.conformance.runner import MAX_ANSWER_BYTES, AnswerTooLarge, client, request
from tests.loopback import loopback, read_fields

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

#: 8 MiB of zeros, gzip-compressed to a few KiB: small on the wire, over the cap once decoded.
BOMB = gzip.compress(bytes(2 * MAX_ANSWER_BYTES))

CHUNK = b"x" * 65536


def request_line(conn: socket.socket) -> tuple[str, str] | None:
    """Read one request whole: its method and target, or None if the client went away."""
    read = read_fields(conn)
    if read is None:
        return None
    method, target, _ = read[0].split(" ", 2)
    return method, target


@pytest.fixture
def endless() -> Iterator[str]:
    """A loopback server answering 200 {} on every path but /endless (every POST, with
    ``/webhook``), whose body it streams fast and never ends; /bomb answers the gzip bomb."""
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                while (got := request_line(conn)) is not None:
                    method, target = got
                    if target.startswith("/endless") or (
                        target.startswith("/webhook") and method == "POST"
                    ):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                        while not stop.is_set():
                            conn.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                        return
                    body = BOMB if target.startswith("/bomb") else b"{}"
                    encoding = b"Content-Encoding: gzip\r\n" if body is BOMB else b""
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%s"
                        b"Content-Length: %d\r\n\r\n%s" % (encoding, len(body), body)
                    )
            except OSError:
                return

    with loopback(answer) as address:
        yield f"http://{address}"
        stop.set()


def said(url: str, method: str = "POST") -> str:
    return (
        f"{method} {url} answered more than {MAX_ANSWER_BYTES} bytes; "
        f"the kit reads at most {MAX_ANSWER_BYTES}"
    )


def test_an_endless_answer_is_a_finding_not_a_budget_run_out(
    endless: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = main(
        ["conformance", "http", endless + "/pay", "--fail-path", "/endless",
         "--only", "server-error-not-stored", "--budget", "30"]
    )  # fmt: skip
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1, err
    assert said(endless + "/endless") in " ".join(out.split()), out
    assert "time budget" not in out
    assert took < 15


def test_an_endless_acknowledgement_is_a_finding(
    endless: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENDLESS_SECRET", SECRET)
    started = time.monotonic()
    code = main(
        ["conformance", "webhooks", endless + "/webhook", "--scheme", "standard-webhooks",
         "--secret", "env:ENDLESS_SECRET", "--only", "signed-accepted", "--budget", "30"]
    )  # fmt: skip
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1, err
    assert said(endless + "/webhook") in " ".join(out.split()), out
    assert took < 15


def test_an_endless_first_answer_is_a_usage_error(
    endless: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["conformance", "http", endless + "/endless", "--budget", "30"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == f"pgonce: error: {said(endless + '/endless')}\n"


def test_a_body_over_the_cap_once_decoded_is_not_read_whole(endless: str) -> None:
    async def send(path: str) -> bytes:
        async with client() as session:
            return (await request(session, "GET", endless + path)).content

    assert asyncio.run(send("/small")) == b"{}"
    with pytest.raises(AnswerTooLarge) as raised:
        asyncio.run(send("/bomb"))
    assert str(raised.value) == said(endless + "/bomb", "GET")
