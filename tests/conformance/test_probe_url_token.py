"""A receiver reached through a gateway that wants ``?token=`` in the URL: the unknown-source
check sent its delivery without the query, so it judged the gateway's 403 instead of the
receiver's answer for a source nobody configured."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, parse_head, read_head

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def gateway(conn: socket.socket) -> None:
    """403 without ?token=ok; behind it, 404 for any path but /webhooks/shop, 401 on it."""
    with conn:
        try:
            read = read_head(conn)
            if read is None:
                return
            line, _, _ = parse_head(read)
            target = line.split(" ")[1]
            path, _, query = target.partition("?")
            status = (
                "403 Forbidden"
                if query != "token=ok"
                else "401 Unauthorized"
                if path == "/webhooks/shop"
                else "404 Not Found"
            )
            conn.sendall(
                f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
        except OSError:
            pass


@pytest.fixture
def behind_gateway() -> Iterator[str]:
    with loopback(gateway) as address:
        yield f"http://{address}"


def test_the_unknown_source_delivery_keeps_the_urls_query(
    behind_gateway: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_SECRET", SECRET)
    code = main(
        ["conformance", "webhooks", behind_gateway + "/webhooks/shop?token=ok", "--scheme",
         "standard-webhooks", "--secret", "env:GATEWAY_SECRET", "--json",
         "--only", "unknown-source-404"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    (check,) = json.loads(out)["checks"]
    assert check["verdict"] == "PASS", check
    assert code == 0, err
