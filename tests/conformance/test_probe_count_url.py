"""A --count-url whose server is down, or answers something that is not HTTP, stops the run with
one line naming the count URL (its password hidden), exit 1; it was an internal error (httpx's
ConnectError or RemoteProtocolError)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.conformance.conftest import ALICE, PAYMENT
from tests.http.conftest import Server
from tests.loopback import loopback, read_head


@pytest.fixture
def not_http() -> Iterator[str]:
    """A loopback server that answers every connection with a line that is not HTTP."""

    def answer(conn: socket.socket) -> None:
        with conn:
            if read_head(conn) is not None:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    with loopback(answer) as address:
        yield f"http://counter:hunter2@{address}/count"


@pytest.fixture
def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    return f"http://counter:hunter2@127.0.0.1:{port}/count"


@pytest.mark.parametrize("count", ["closed_port", "not_http"])
def test_an_unreadable_count_url_is_one_line(
    test_app: Server, count: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    count_url: str = request.getfixturevalue(count)
    code = main(
        ["conformance", "http", test_app.url + "/payments", "--body", PAYMENT.decode(),
         "--header", f"Authorization: {ALICE['Authorization']}", "--count-url", count_url]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("pgonce: error: cannot read the count at http://counter:***@127.0.0.1:")
    assert "internal error" not in err
    assert "hunter2" not in err
