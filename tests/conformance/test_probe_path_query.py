"""The path options (--fail-path, --cookie-path, --slow-path, --safe-path) dropped the target
URL's query string: a gateway's ``?token=`` had to be added by hand to each path. The URL's
query now goes to those paths as it goes to the URL itself, unless a path gives its own."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from pgonce.conformance.http_run import same_origin
from tests.conformance.test_probe_endless_answer import request_line
from tests.loopback import loopback


@pytest.mark.parametrize(
    ("path", "sent"),
    [
        ("/fail", "https://h:8443/fail?token=t1&x=2"),
        ("/fail?own=1", "https://h:8443/fail?own=1"),
    ],
)
def test_a_path_takes_the_url_query_unless_it_has_its_own(path: str, sent: str) -> None:
    assert same_origin("https://h:8443/pay/x?token=t1&x=2", path) == sent


@pytest.fixture
def recording() -> Iterator[tuple[str, list[str]]]:
    """A loopback server answering 500 on /fail and 200 {} elsewhere, keeping every target."""
    targets: list[str] = []

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                while (got := request_line(conn)) is not None:
                    targets.append(got[1])
                    status = (
                        b"500 Internal Server Error" if got[1].startswith("/fail") else b"200 OK"
                    )
                    conn.sendall(
                        b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 2\r\n\r\n{}" % status
                    )
            except OSError:
                return

    with loopback(answer) as address:
        yield f"http://{address}", targets


def test_the_path_options_carry_the_url_query(
    recording: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, targets = recording
    main(
        ["conformance", "http", url + "/pay?token=hunter2", "--fail-path", "/fail",
         "--safe-path", "/items?page=2", "--only", "server-error-not-stored",
         "--only", "safe-methods-untouched"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert "/fail?token=hunter2" in targets, (targets, out, err)
    assert "/items?page=2" in targets, targets
    assert not {"/fail", "/items?page=2&token=hunter2"} & set(targets), targets
    assert "hunter2" not in out + err
