"""A server that fails (a 500 from the application, a 502 or 504 HTML page from the reverse proxy
in front of it) is said to have failed: the webhook checks counted its 5xx answers as "refusals
that are not application/problem+json", and the HTTP kit told the user to fix their --body and
--header, as if the request had been refused."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, read_headers

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

PAGES = {
    500: ("Internal Server Error", "text/plain", b"Internal Server Error"),
    502: ("Bad Gateway", "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
    504: (
        "Gateway Timeout",
        "text/html",
        b"<html><body><h1>504 Gateway Time-out</h1></body></html>",
    ),
}


def answering(status: int) -> Callable[[socket.socket], None]:
    reason, media, page = PAGES[status]

    def answer(conn: socket.socket) -> None:
        with conn:
            try:
                if read_headers(conn) is not None:
                    conn.sendall(
                        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n\r\n%s"
                        % (status, reason.encode(), media.encode(), len(page), page)
                    )
            except OSError:
                pass

    return answer


@pytest.fixture(params=[500, 502, 504])
def failing(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """A server answering every request with the status, and the status."""
    with loopback(answering(request.param)) as address:
        yield f"http://{address}", request.param


def test_webhook_checks_call_a_5xx_a_server_failure_not_a_refusal(
    failing: tuple[str, int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = failing
    monkeypatch.setenv("FAILING_SECRET", SECRET)
    code = main(
        ["conformance", "webhooks", url + "/webhooks/shop", "--scheme", "standard-webhooks",
         "--secret", "env:FAILING_SECRET", "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    problem = checks.pop("errors-problem-json")
    # Not one answer was a refusal: nothing to judge as problem+json, and the reason is said.
    assert problem["verdict"] == "SKIP", problem
    assert "the server failed (5xx)" in problem["evidence"]
    assert "not application/problem+json" not in out
    for name, check in checks.items():
        if check["verdict"] == "FAIL":
            assert "a server failure" in check["evidence"], (name, check["evidence"])
    assert "Traceback" not in err


def test_the_http_kit_says_the_server_failed_on_the_first_request(
    failing: tuple[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    url, status = failing
    code = main(["conformance", "http", url + "/payments"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"with a new key answered {status}, a server failure: the endpoint must succeed" in err
    # The request was not refused: changing --body or --header is not the advice.
    assert "--body" not in err
    assert len(err.strip().splitlines()) == 1, err
