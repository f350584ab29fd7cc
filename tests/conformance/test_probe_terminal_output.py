"""What a server sends reaches the terminal escaped: ``pgonce send`` printed the answer's body as
it came (an escape sequence drove the terminal, an HTML page's newlines broke the one-line
summary), and the kit's table and errors printed a header's control characters as they came.
``pgonce send`` also called an answer broken off mid-body "cannot reach URL"."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgonce.cli import main
from tests.loopback import loopback, read_headers

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
CONFIG = '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SEND_SECRET"]\n'


def answering(raw: bytes) -> Iterator[str]:
    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                if read_headers(conn) is not None:
                    conn.sendall(raw)
            except OSError:
                pass

    with loopback(answer) as address:
        yield f"http://{address}"


PAGE = b"<html>\n<h1>502 Bad Gateway</h1>\x1b[2J\n</html>"


@pytest.fixture
def proxy_page() -> Iterator[str]:
    yield from answering(
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (len(PAGE), PAGE)
    )


@pytest.fixture
def broken_off() -> Iterator[str]:
    yield from answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")


@pytest.fixture
def control_headers() -> Iterator[str]:
    # A C1 control (CSI, 0x9b) is obs-text to HTTP, and a command to many terminals.
    yield from answering(
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        b"Idempotency-Key-Expires: \x9b2J\r\nConnection: close\r\n\r\n{}"
    )


@pytest.fixture
def control_redirect() -> Iterator[str]:
    yield from answering(
        b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\x9b2J\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n"
    )


def send(config: Path, url: str) -> int:
    config.write_text(CONFIG)
    return main(["send", "--config", str(config), "--source", "shop", "--url", url])


def test_send_prints_a_proxy_page_on_one_line_escaped(
    proxy_page: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEND_SECRET", SECRET)
    code = send(tmp_path / "pgonce.toml", proxy_page)
    out = capsys.readouterr().out
    assert code == 1
    assert out == ("1 × 502 <html>\\u000a<h1>502 Bad Gateway</h1>\\u001b[2J\\u000a</html>\n")


def test_send_says_an_answer_broken_off_mid_body_is_incomplete(
    broken_off: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEND_SECRET", SECRET)
    code = send(tmp_path / "pgonce.toml", broken_off)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(
        f"pgonce: error: {broken_off}/webhooks/shop gave no complete answer: peer closed "
    ), err


def test_the_table_escapes_control_characters_from_the_server(
    control_headers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["conformance", "http", control_headers + "/payments", "--key-optional",
         "--only", "key-lifetime-header"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    assert "\x9b" not in out
    assert "\\u009b2J" in out


def test_a_redirect_location_is_shown_encoded(
    control_redirect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["conformance", "http", control_redirect + "/payments"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "a redirect to /elsewhere%C2%9B2J (not followed)" in err


@pytest.fixture
def moved() -> Iterator[str]:
    yield from answering(
        b"HTTP/1.1 301 Moved Permanently\r\nLocation: https://svc.example/?token=hunter2\r\n"
        b"Content-Length: 0\r\nConnection: close\r\n\r\n"
    )


def test_send_says_where_a_redirect_points(
    moved: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It printed "1 × 301 " and nothing else.
    monkeypatch.setenv("SEND_SECRET", SECRET)
    code = send(tmp_path / "pgonce.toml", moved)
    out = capsys.readouterr().out
    assert code == 1
    assert out == "1 × 301 a redirect to https://svc.example/?token=*** (not followed)\n"
