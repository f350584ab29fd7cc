"""An https URL whose server closes the connection without a word (a plain-HTTP port that drops
what it cannot parse, a load balancer without a certificate) is named with the reason: the error
read "cannot reach URL: ConnectError" with nothing after it (the TLS layer's end of stream carries
no message)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.loopback import close_unanswered, loopback


@pytest.fixture
def closing() -> Iterator[str]:
    """A loopback server that reads what comes first and closes the connection unanswered."""
    with loopback(close_unanswered) as address:
        yield address


@pytest.mark.parametrize(
    "args",
    [
        ("http", "/payments"),
        ("webhooks", "/webhooks/shop", "--scheme", "stripe", "--secret", "env:CLOSING_SECRET"),
    ],
)
def test_a_tls_handshake_the_server_closes_is_named_with_the_reason(
    closing: str,
    args: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLOSING_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    kind, path, *rest = args
    code = main(["conformance", kind, f"https://{closing}{path}", *rest])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"pgonce: error: cannot reach https://{closing}{path}: ConnectError: the server closed "
        "the connection during the TLS handshake: does it serve TLS on that port? (http:// "
        "if not)\n"
    )
