"""``pgonce send`` says why a delivery got no answer: "cannot reach URL: " ended there when the
server closed the connection unanswered (a TLS handshake on a plain port) or never answered, as
those errors of the HTTP client carry no message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pgonce.cli import main
from tests.loopback import close_unanswered, loopback

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def closing() -> Iterator[str]:
    """A loopback server that reads what comes first and closes the connection unanswered."""
    with loopback(close_unanswered) as address:
        yield address


def test_a_tls_handshake_the_server_closes_is_named_with_the_reason(
    closing: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEND_SECRET", SECRET)
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SEND_SECRET"]\n'
    )
    code = main(
        ["send", "--config", str(config), "--source", "shop", "--url", f"https://{closing}"]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"pgonce: error: cannot reach https://{closing}/webhooks/shop: ConnectError: the server "
        "closed the connection during the TLS handshake: does it serve TLS on that port? "
        "(http:// if not)\n"
    )


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--url", "notaurl"], "--url: 'notaurl' is not an http(s) URL"),
        (["--url", "ftp://u:hunter2@host/x"], "--url: 'ftp://u:***@host/x' is not an http(s) URL"),
        (["--body", "notjson"], "--body is not JSON (Expecting value: line 1 column 1 (char 0))"),
        (["--id", ""], "argument --id: is empty"),
    ],
)
def test_a_bad_url_body_or_id_is_a_usage_error(
    options: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was sent (the body as application/json, the id empty) or failed as the HTTP client's
    # error, exit 1, where the help promises a usage error.
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SEND_SECRET"]\n'
    )
    with pytest.raises(SystemExit) as ended:
        main(["send", "--config", str(config), "--source", "shop", *options])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "hunter2" not in err
