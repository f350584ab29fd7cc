"""A server that takes the request and never answers fails the run within the kit's request
timeout, saying so: the error read "cannot reach URL: " with nothing after it (httpx's timeouts
carry no message)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from pgonce.conformance.runner import REQUEST_TIMEOUT
from tests.loopback import loopback


@pytest.fixture
def silent() -> Iterator[str]:
    """A loopback server that reads every request and never answers it."""
    held: list[socket.socket] = []
    with loopback(held.append) as address:
        yield f"http://{address}"
    for conn in held:
        conn.close()


@pytest.mark.parametrize(
    "args",
    [
        ("http", "/payments"),
        ("webhooks", "/webhooks/shop", "--scheme", "stripe", "--secret", "env:SILENT_SECRET"),
    ],
)
def test_a_server_that_never_answers_is_named_with_the_reason(
    silent: str,
    args: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SILENT_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    kind, path, *rest = args
    started = time.monotonic()
    code = main(["conformance", kind, silent + path, *rest])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"pgonce: error: cannot reach {silent}{path}: "
        f"ReadTimeout: no answer within {REQUEST_TIMEOUT:.0f} s\n"
    )
    assert took < REQUEST_TIMEOUT * 2 + 5
