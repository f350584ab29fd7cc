"""What servers behind real proxies answer is said for what it is: a redirect with where it
points (it read "answered 301, not 2xx: give the --body and --header that the endpoint
accepts"), a connection closed mid-body as an incomplete answer from the server named (it read
"cannot reach URL", and in a check "no answer" without the request), and an original marked
``Idempotent-Replayed: true`` as the lie it is."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from pgonce.cli import main
from tests.loopback import loopback, read_headers

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
WEBHOOKS = ["--scheme", "standard-webhooks", "--secret", "env:PROXY_SECRET"]

Answer = Callable[[socket.socket, int, dict[str, str]], None]


def send(conn: socket.socket, status: str, body: bytes, extra: str = "") -> None:
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n".encode()
        + body
    )


def server(answer: Answer) -> Iterator[str]:
    """A loopback server handing each whole request (its number from 1, its headers) to
    ``answer``."""
    lock = threading.Lock()
    seen = [0]

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                request = read_headers(conn)
                if request is None:
                    return
                with lock:
                    seen[0] += 1
                    number = seen[0]
                answer(conn, number, request)
            except OSError:
                pass

    with loopback(handle) as address:
        yield f"http://{address}"


def redirecting(conn: socket.socket, number: int, headers: dict[str, str]) -> None:
    where = "Location: https://api.example/payments?token=hunter2\r\n"
    send(conn, "307 Temporary Redirect", b"", where)


def closing_mid_body(after: int) -> Answer:
    """Answers like an idempotent endpoint up to request ``after``, then breaks off mid-body."""
    cache: dict[str, bytes] = {}

    def answer(conn: socket.socket, number: int, headers: dict[str, str]) -> None:
        if number > after:
            conn.sendall(b'HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{"id":')
            return
        idempotent(cache)(conn, number, headers)

    return answer


def idempotent(cache: dict[str, bytes], *, always_marked: bool = False) -> Answer:
    def answer(conn: socket.socket, number: int, headers: dict[str, str]) -> None:
        key = headers.get("idempotency-key")
        if key is None:
            send(conn, "400 Bad Request", b"{}")
            return
        marked = "Idempotent-Replayed: true\r\n"
        if key in cache:
            send(conn, "201 Created", cache[key], marked)
            return
        cache[key] = json.dumps({"id": uuid.uuid4().hex}).encode()
        send(conn, "201 Created", cache[key], marked if always_marked else "")

    return answer


@pytest.fixture
def redirect() -> Iterator[str]:
    yield from server(redirecting)


@pytest.fixture
def broken_off() -> Iterator[str]:
    yield from server(closing_mid_body(after=0))


@pytest.fixture
def broken_off_later() -> Iterator[str]:
    yield from server(closing_mid_body(after=1))


@pytest.fixture
def always_marked() -> Iterator[str]:
    yield from server(idempotent({}, always_marked=True))


def test_a_redirected_endpoint_is_said_to_redirect(
    redirect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["conformance", "http", redirect + "/payments"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"pgonce: error: POST {redirect}/payments with a new key answered 307, a redirect to "
        "https://api.example/payments?token=*** (not followed): give the URL the endpoint "
        "really answers on\n"
    )


def test_a_redirected_receiver_is_said_to_redirect(
    redirect: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROXY_SECRET", SECRET)
    code = main(["conformance", "webhooks", redirect + "/webhooks/shop", *WEBHOOKS, "--json"])
    out, err = capsys.readouterr()
    assert code == 1, err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["signed-accepted"]["evidence"].startswith(
        "a validly signed delivery answered 307, a redirect to "
        "https://api.example/payments?token=*** (not followed);"
    )
    assert "hunter2" not in out


@pytest.mark.parametrize(
    ("kind", "path", "rest"), [("http", "/payments", []), ("webhooks", "/webhooks/shop", WEBHOOKS)]
)
def test_an_answer_broken_off_mid_body_is_not_called_unreachable(
    broken_off: str,
    kind: str,
    path: str,
    rest: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROXY_SECRET", SECRET)
    code = main(["conformance", kind, broken_off + path, *rest])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"pgonce: error: {broken_off}{path} gave no complete answer: RemoteProtocolError: peer "
        "closed connection without sending complete message body (received 6 bytes, expected "
        "100)\n"
    )


def test_a_check_whose_answer_broke_off_names_the_request(
    broken_off_later: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = broken_off_later + "/payments?token=hunter2"
    code = main(["conformance", "http", url, "--json", "--only", "key-required",
                 "--only", "concurrent-once", "--only", "in-flight-409"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["key-required"]["evidence"] == (
        f"no complete answer to POST {broken_off_later}/payments?token=***: RemoteProtocolError: "
        "peer closed connection without sending complete message body (received 6 bytes, "
        "expected 100)"
    )
    # The race never got an answer: there were no copies to have arrived "while their original
    # ran" (it read "none of 0 concurrent copies arrived while its original ran").
    assert checks["in-flight-409"]["verdict"] == "SKIP"
    assert checks["in-flight-409"]["evidence"].startswith(
        "no concurrent copies were answered (see concurrent-once)"
    )
    assert "hunter2" not in out


def test_an_original_marked_as_a_replay_fails_replay_identical(
    always_marked: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["conformance", "http", always_marked + "/payments", "--json", "--only", "replay-identical"]
    )
    out, err = capsys.readouterr()
    assert code == 1, err
    (check,) = json.loads(out)["checks"]
    assert check["verdict"] == "FAIL"
    assert check["evidence"].startswith(
        "the original, with a new key, is marked Idempotent-Replayed: true;"
    )


def upstream_lost(conn: socket.socket, number: int, headers: dict[str, str]) -> None:
    """The first request answered, then the proxy's upstream gone: a 502 page for every other."""
    if number == 1:
        send(conn, "201 Created", b'{"id": 1}')
        return
    page = b"<html><h1>502 Bad Gateway</h1></html>"
    conn.sendall(
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (len(page), page)
    )


@pytest.fixture
def lost() -> Iterator[str]:
    yield from server(upstream_lost)


def test_two_equal_502_pages_are_not_called_the_originals_answer(
    lost: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both the original and the other request got the proxy's page: it read "the other request
    # got the original's answer" and "the second caller got the first one's answer".
    code = main(
        ["conformance", "http", lost + "/payments", "--json", "--other-header", "X-Caller: bob",
         "--only", "mismatch-other-body", "--only", "principal-scopes"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["mismatch-other-body"]["evidence"].startswith(
        "the original answered 502, a server failure, not 2xx;"
    )
    assert checks["principal-scopes"]["evidence"].startswith(
        "the first caller's request answered 502, a server failure, not 2xx;"
    )
    assert "answer;" not in out
    assert "got the" not in out


def test_the_originals_headers_are_not_judged_on_a_502_page(
    lost: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It read "the endpoint's answer carries no Location header" and "no Idempotency-Key-Expires
    # header": the headers were the proxy's page's.
    code = main(
        ["conformance", "http", lost + "/payments", "--json", "--only", "replay-keeps-location",
         "--only", "key-lifetime-header"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    for check in json.loads(out)["checks"]:
        assert check["verdict"] == "SKIP", check
        assert check["evidence"] == (
            "the original answered 502, a server failure, not 2xx: nothing to judge (see "
            "replay-identical)"
        )
