"""The Idempotency-Key middleware through a real uvicorn server, on real PostgreSQL.

What every adapter must do (bad keys, replays, 409, 422, 5xx, 413, concurrency, kill -9) is in the
conformance suite, ``tests/adapters/``, which runs this app too; here is what goes beyond it.

Every answer is checked against the database: the number of payment rows is the number of times
the work really happened, and the keys table is what a retry will see.
"""

from __future__ import annotations

import threading
import time
import uuid
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.http.conftest import Server, ServerFactory
from tests.keys.helpers import wait_until_blocked

ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}
PAYMENT = {"amount": 1000, "currency": "EUR"}


def new_key() -> str:
    return str(uuid.uuid4())


def post(
    server: Server,
    path: str,
    key: str | None,
    body: Any = PAYMENT,
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> httpx.Response:
    all_headers = {**ALICE, **(headers or {})}
    if key is not None:
        all_headers["Idempotency-Key"] = key
    return httpx.post(server.url + path, json=body, headers=all_headers, timeout=30, **kwargs)


def count(db: psycopg.Connection[Any], table: str) -> int:
    row = db.execute(f"SELECT count(*) FROM {table}").fetchone()  # table names are literals
    assert row is not None
    return int(row[0])


def keys(db: psycopg.Connection[Any]) -> int:
    return count(db, "pgonce.keys")


def payments(db: psycopg.Connection[Any]) -> int:
    return count(db, "payments")


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    document: dict[str, Any] = response.json()
    assert document["status"] == status
    assert document["title"]
    return document


# --- the happy path and replays -------------------------------------------------------------


def test_a_204_is_replayed_as_it_was_sent_without_a_content_length(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    # RFC 9110 8.6: a server must not send Content-Length in a 204; the original had none.
    key = new_key()
    first = post(server, "/empty", key)
    second = post(server, "/empty", key)
    assert first.status_code == second.status_code == 204
    assert "content-length" not in first.headers
    assert "content-length" not in second.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert second.headers["x-custom"] == "kept"
    assert second.content == first.content == b""
    assert payments(db) == 1


def test_key_expiry_is_advertised_on_first_answer_and_replays(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/payments", key)
    second = post(server, "/payments", key)
    expires = parsedate_to_datetime(first.headers["idempotency-key-expires"])
    assert second.headers["idempotency-key-expires"] == first.headers["idempotency-key-expires"]
    row = db.execute("SELECT claimed_at FROM pgonce.keys").fetchone()
    assert row is not None
    # Claim time plus the 24 hours' default retention, to the second an HTTP-date can carry.
    assert abs((expires - row[0]).total_seconds() - 24 * 3600) < 1


def test_quoted_key_is_the_same_key_as_bare(server: Server, db: psycopg.Connection[Any]) -> None:
    first = post(server, "/payments", '"order-42"')
    second = post(server, "/payments", "order-42")
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert payments(db) == 1


def test_json_key_order_and_whitespace_do_not_make_another_request(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    headers = {**ALICE, "Idempotency-Key": key, "Content-Type": "application/json"}
    first = httpx.post(
        server.url + "/payments", content=b'{"amount":5,"currency":"EUR"}', headers=headers
    )
    second = httpx.post(
        server.url + "/payments",
        content=b'{\n  "currency" : "EUR",  "amount": 5\n}',
        headers=headers,
    )
    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"
    assert payments(db) == 1


def test_a_json_body_with_a_lone_surrogate_is_fingerprinted_not_a_500(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    # JSON may escape a lone surrogate (\ud800), which no UTF-8 text can carry: the canonical
    # form of the body is hashed, never sent, so it keeps the surrogate rather than failing.
    key = new_key()
    headers = {**ALICE, "Idempotency-Key": key, "Content-Type": "application/json"}
    body = b'{"amount": 5, "currency": "EUR", "note": "\\ud800"}'
    first = httpx.post(server.url + "/payments", content=body, headers=headers)
    second = httpx.post(server.url + "/payments", content=body, headers=headers)
    other = httpx.post(
        server.url + "/payments", content=body.replace(b"d800", b"d801"), headers=headers
    )
    assert first.status_code == second.status_code == 201
    assert second.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422  # another surrogate, another request
    assert payments(db) == 1


# --- which requests are handled ---------------------------------------------------------------


def test_get_passes_through_and_stores_nothing(server: Server, db: psycopg.Connection[Any]) -> None:
    created = post(server, "/payments", new_key())
    for method in ("GET", "HEAD", "OPTIONS"):
        response = httpx.request(
            method,
            server.url + created.headers["location"],
            headers={**ALICE, "Idempotency-Key": new_key()},
        )
        assert response.status_code in (200, 405), method
        assert "idempotent-replayed" not in response.headers
    assert keys(db) == 1


def test_methods_are_configurable_per_route(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(routes={"/cookie": [], "/untouched": ["POST"]})
    # /cookie is turned off: no key needed, nothing stored, no transaction handed out (so the
    # endpoint cannot get one and fails loudly instead of writing outside any claim).
    response = post(server, "/cookie", None)
    assert response.status_code == 500
    assert keys(db) == 0
    assert_problem(post(server, "/untouched", None), 400)


def test_without_require_key_a_keyless_request_passes_unprotected(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(require_key=False)
    response = post(server, "/untouched", None)
    assert response.status_code == 200
    assert keys(db) == 0


def test_a_key_of_255_characters_is_accepted(server: Server, db: psycopg.Connection[Any]) -> None:
    assert post(server, "/payments", "k" * 255).status_code == 201


def test_two_key_headers_are_400(server: Server, db: psycopg.Connection[Any]) -> None:
    response = httpx.post(
        server.url + "/payments",
        json=PAYMENT,
        headers=[
            ("Authorization", ALICE["Authorization"]),
            ("Idempotency-Key", "a"),
            ("Idempotency-Key", "b"),
        ],
    )
    assert_problem(response, 400)
    assert payments(db) == 0


# --- mismatch, in flight, waiting -------------------------------------------------------------


def test_the_query_string_is_part_of_the_request(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    assert post(server, "/stream?chunks=1&size=10", key).status_code == 201
    assert_problem(post(server, "/stream?chunks=1&size=11", key), 422)
    assert_problem(post(server, "/cookie", key), 422)  # another path too
    assert payments(db) == 1


class Blocked:
    """A request to /block running in a thread, its write done, its transaction held open."""

    def __init__(self, server: Server, key: str, folder: Path, path: str | None = None) -> None:
        self.folder = folder
        self.server = server
        self.path = path or block_path(folder)
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(server, key), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not (folder / "started").exists():
            assert time.monotonic() < deadline, "the blocking endpoint never started"
            assert self.thread.is_alive() or self.response is None, self.response
            time.sleep(0.01)

    def _run(self, server: Server, key: str) -> None:
        try:
            self.response = post(server, self.path, key)
        except BaseException as error:  # the server may be killed under it
            self.error = error

    def release(self) -> httpx.Response:
        (self.folder / "gate").touch()
        self.thread.join(timeout=30)
        if self.response is None:
            waiting = "still waiting" if self.thread.is_alive() else repr(self.error)
            raise AssertionError(
                f"no answer ({waiting}); the server's log:\n{self.server.log.read_text()}"
            )
        return self.response

    def backend(self) -> int:
        """The pid of the PostgreSQL backend that holds the request's transaction."""
        return int((self.folder / "backend").read_text())


def block_path(folder: Path) -> str:
    return f"/block?directory={folder}"


def waiting_duplicate(
    server: Server, key: str, path: str, db: psycopg.Connection[Any]
) -> tuple[list[httpx.Response], threading.Thread]:
    """Send a duplicate in a thread; return once it waits on the original's row lock."""
    result: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: result.append(post(server, path, key)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 20
    pid = None
    while pid is None:
        assert time.monotonic() < deadline, "the duplicate never waited"
        row = db.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
        pid = row[0] if row else None
        time.sleep(0.01)
    wait_until_blocked(db, pid)
    return result, waiter


@pytest.mark.pooled
def test_with_waiting_enabled_a_duplicate_waits_then_replays(
    make_server: ServerFactory, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    server = make_server(wait_ms=20_000)
    key = new_key()
    original = Blocked(server, key, tmp_path)
    result, waiter = waiting_duplicate(server, key, block_path(tmp_path), db)
    first = original.release()
    waiter.join(timeout=30)
    assert result, "the waiting duplicate got no answer"
    assert result[0].status_code == 201
    assert result[0].content == first.content
    assert result[0].headers["idempotent-replayed"] == "true"
    assert payments(db) == 1


def test_a_waiting_duplicate_runs_the_work_itself_when_the_original_rolls_back(
    make_server: ServerFactory, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    server = make_server(wait_ms=20_000)
    key = new_key()
    path = block_path(tmp_path) + "&status=503"  # the original fails: it rolls back
    original = Blocked(server, key, tmp_path, path)
    result, waiter = waiting_duplicate(server, key, path, db)
    assert original.release().status_code == 503
    waiter.join(timeout=30)
    assert result, "the waiting duplicate got no answer"
    assert result[0].status_code == 503  # it won the freed key and ran the endpoint itself
    assert "idempotent-replayed" not in result[0].headers
    assert len((tmp_path / "runs").read_text().splitlines()) == 2
    assert keys(db) == 0
    assert payments(db) == 0


# --- what is not stored -----------------------------------------------------------------------


def test_a_5xx_is_stored_when_the_key_store_keeps_server_errors(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(store_server_errors=True)
    key = new_key()
    first = post(server, "/fail", key)
    second = post(server, "/fail", key)
    assert second.status_code == 503
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert payments(db) == 1


def test_framework_validation_failures_are_not_stored(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    invalid = post(server, "/payments", key, body={"amount": -1, "currency": "EUR"})
    assert invalid.status_code == 422  # FastAPI's validation, before the endpoint ran
    assert keys(db) == 0
    # Not consumed: the corrected request with the same key is not a mismatch.
    assert post(server, "/payments", key).status_code == 201
    # Bad credentials: the key scope is unknown, the app answers 401, nothing is stored.
    unauthorized = post(server, "/payments", new_key(), headers={"Authorization": "Bearer x"})
    assert unauthorized.status_code == 401
    assert keys(db) == 1
    assert payments(db) == 1


def test_an_endpoint_that_never_began_is_not_stored(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/untouched", key)
    second = post(server, "/untouched", key)
    assert first.status_code == second.status_code == 200
    assert first.json() != second.json()
    assert keys(db) == 0


def test_an_endpoint_that_begins_without_the_database_is_stored(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/no-db", key)
    second = post(server, "/no-db", key)
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"


# --- headers, bodies, limits ------------------------------------------------------------------


def test_a_streaming_response_is_stored_in_full(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/stream?chunks=50&size=100", key)
    assert first.status_code == 201
    assert len(first.content) == 5000
    second = post(server, "/stream?chunks=50&size=100", key)
    assert second.content == first.content
    assert second.headers["content-length"] == "5000"
    assert payments(db) == 1


def test_a_response_over_the_limit_is_refused_and_rolled_back(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(max_response_bytes=1000)
    response = post(server, "/stream?chunks=50&size=100", new_key())
    assert_problem(response, 500)
    assert payments(db) == 0
    assert keys(db) == 0


# --- concurrency and crashes ------------------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_unserializable_numbers_get_a_problem_not_a_500(
    server: Server, db: psycopg.Connection[Any], number: str
) -> None:
    # Found by the fault suite: FastAPI's default handler echoed the input and could not encode it.
    response = httpx.post(
        server.url + "/payments",
        content=f'{{"amount": {number}, "currency": "EUR"}}'.encode(),
        headers={**ALICE, "Idempotency-Key": new_key(), "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    assert number not in response.text
    assert keys(db) == 0


def test_a_lone_surrogate_in_a_field_the_model_reads_is_a_problem_not_a_500(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    # Three characters, one a lone surrogate that no UTF-8 text (and so no INSERT) can carry:
    # the model refuses it before the endpoint begins, and nothing is stored.
    response = httpx.post(
        server.url + "/payments",
        content=b'{"amount": 5, "currency": "\\ud800AB"}',
        headers={**ALICE, "Idempotency-Key": new_key(), "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    assert keys(db) == 0


def test_database_lost_mid_request_is_503_and_the_retry_pays_once(
    server: Server, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    # Found by the fault suite: a connection lost after the endpoint began was a 500.
    key = new_key()
    original = Blocked(server, key, tmp_path)
    # The request's own backend, by its pid, not whichever is idle in a transaction. With a
    # timeout pg_terminate_backend() returns once the backend has exited (false if it never
    # does), so the gate opens on a connection the server has closed: the completion always
    # meets the same lost connection, not a backend still on its way out.
    killed = db.execute(
        "SELECT pg_terminate_backend(pid, 30000) FROM pg_stat_activity "
        "WHERE pid = %s AND state = 'idle in transaction'",
        (original.backend(),),
    ).fetchall()
    assert killed == [(True,)]
    lost = original.release()
    document = assert_problem(lost, 503)
    assert "nothing half-done was kept" in document["detail"]
    assert int(lost.headers["retry-after"]) >= 1
    assert payments(db) == 0
    for name in ("gate", "started", "backend"):
        (tmp_path / name).unlink()
    retry = Blocked(server, key, tmp_path).release()
    assert retry.status_code == 201
    assert payments(db) == 1
