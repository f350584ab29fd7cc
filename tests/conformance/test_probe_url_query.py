"""A token in a URL's query string (``?token=``, ``?api_key=``) is hidden wherever the kit and
``pgonce send`` show the URL, as a password in its user part is: it was printed whole in the
report's first line, in "cannot reach URL" and in usage errors. The path stays visible."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgonce.cli import main
from pgonce.core.urls import public
from tests.conformance.test_probe_server_failures import answering
from tests.loopback import loopback, read_request

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://h/pay/x?token=hunter2", "https://h/pay/x?token=***"),
        ("https://h/p?a=1&api_key=hunter2&flag&e=", "https://h/p?a=***&api_key=***&***&e="),
        ("https://u:hunter2@h:8443/p?sig=hunter2#hunter2", "https://u:***@h:8443/p?sig=***#***"),
        ("http://h/p?hunter2", "http://h/p?***"),
        ("http://u:hunter2@[::1/p?token=hunter2", "http://***@[::1/p?token=***"),
        ("http://h/p", "http://h/p"),
        ("/fail?token=hunter2", "/fail?token=***"),
    ],
)
def test_public_hides_query_values_and_keeps_the_path(url: str, shown: str) -> None:
    assert public(url) == shown


@pytest.fixture
def failing() -> Iterator[str]:
    with loopback(answering(500)) as address:
        yield f"http://{address}"


def test_the_http_kit_hides_a_query_token(failing: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["conformance", "http", failing + "/payments?token=hunter2"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"POST {failing}/payments?token=*** with a new key" in err
    assert "hunter2" not in err


def test_the_webhook_report_hides_a_query_token(
    failing: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUERY_SECRET", SECRET)
    code = main(
        ["conformance", "webhooks", failing + "/webhooks/shop?api_key=hunter2",
         "--scheme", "standard-webhooks", "--secret", "env:QUERY_SECRET", "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, err
    assert json.loads(out)["target"] == f"{failing}/webhooks/shop?api_key=***"
    assert "hunter2" not in out + err


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["http://[::1/pay?token=hunter2"], "'http://[::1/pay?token=***' is not an http(s) URL"),
        (["http://h:99999/pay?token=hunter2"], "'http://h:99999/pay?token=***' is not an http"),
        (["ftp://h/pay?token=hunter2"], "'ftp://h/pay?token=***' is not an http(s) URL"),
        (
            ["http://h/pay", "--fail-path", "fail?token=hunter2"],
            "'fail?token=***' must be a path on the endpoint's server",
        ),
    ],
)
def test_a_bad_url_or_path_is_refused_without_its_query_values(
    options: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["conformance", "http", *options])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "hunter2" not in err


def test_send_keeps_the_query_after_the_source_path_and_hides_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The query swallowed the path (".../?token=x/webhooks/shop") and was printed whole.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    monkeypatch.setenv("SEND_SECRET", SECRET)
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SEND_SECRET"]\n'
    )
    url = f"http://127.0.0.1:{port}/?token=hunter2"
    code = main(["send", "--config", str(config), "--source", "shop", "--url", url])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(
        f"pgonce: error: cannot reach http://127.0.0.1:{port}/webhooks/shop?token=***: "
    ), err
    assert "hunter2" not in err


def test_send_delivers_to_the_source_path_with_the_query(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bytes] = []

    def answer(conn: socket.socket) -> None:
        with conn:
            read = read_request(conn)
            if read is None:
                return
            seen.append(read[0].split(b"\r\n")[0])
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    monkeypatch.setenv("SEND_SECRET", SECRET)
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SEND_SECRET"]\n'
    )
    with loopback(answer) as address:
        url = f"http://{address}/base/?token=hunter2"
        code = main(["send", "--config", str(config), "--source", "shop", "--url", url])
    out = capsys.readouterr().out
    assert code == 0, out
    assert seen == [b"POST /base/webhooks/shop?token=hunter2 HTTP/1.1"]
