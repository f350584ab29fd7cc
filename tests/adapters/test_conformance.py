"""The Idempotency-Key behaviour every adapter must show, through its real server.

Each test runs once per adapter (``tests/adapters/conftest.py``). Effects are counted in the
database: the number of payment rows is the number of times the work really happened, and the keys
table is what a retry will see.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.http.conftest import Server, ServerFactory
from tests.http.test_http_middleware import (
    ALICE,
    BOB,
    PAYMENT,
    Blocked,
    assert_problem,
    block_path,
    keys,
    new_key,
    payments,
    post,
)


def test_a_retry_replays_the_byte_identical_answer_and_pays_once(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/payments", key)
    second = post(server, "/payments", key)
    assert first.status_code == second.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert second.headers["location"] == first.headers["location"]
    assert second.headers["content-type"] == first.headers["content-type"]
    assert int(second.headers["content-length"]) == len(first.content)
    assert second.headers["idempotency-key-expires"] == first.headers["idempotency-key-expires"]
    assert payments(db) == 1
    assert keys(db) == 1


def test_a_missing_key_is_400(server: Server, db: psycopg.Connection[Any]) -> None:
    assert_problem(post(server, "/payments", None), 400)
    assert payments(db) == 0


@pytest.mark.parametrize(
    "value",
    ["", '""', "k" * 256, "ab\tcd", '"abc', '"a\\bc"'],
    ids=["empty", "empty-sf-string", "over-255", "control-character", "unterminated", "escape"],
)
def test_an_empty_oversized_or_malformed_key_is_400(
    server: Server, db: psycopg.Connection[Any], value: str
) -> None:
    document = assert_problem(post(server, "/payments", value), 400)
    if value.strip('"'):
        assert value.strip('"') not in json.dumps(document)  # never echoes the key
    assert payments(db) == 0
    assert keys(db) == 0


def test_a_replay_never_carries_set_cookie(server: Server, db: psycopg.Connection[Any]) -> None:
    key = new_key()
    first = post(server, "/cookie", key)
    assert "secret-session-id" in first.headers["set-cookie"]
    second = post(server, "/cookie", key)
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert "set-cookie" not in second.headers
    assert second.headers["x-custom"] == "kept"
    row = db.execute("SELECT response_headers::text FROM pgonce.keys").fetchone()
    assert row is not None
    assert "secret-session-id" not in row[0]
    assert payments(db) == 1


def test_the_same_key_with_another_request_is_422(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first = post(server, "/payments", key)
    other = post(server, "/payments", key, body={"amount": 1, "currency": "EUR"})
    document = assert_problem(other, 422)
    assert key not in other.text  # never echoes the key or the original's answer
    assert first.text not in other.text
    assert "id" not in document
    assert post(server, "/payments", key).content == first.content
    assert payments(db) == 1


def test_a_duplicate_in_flight_is_409_with_retry_after(
    server: Server, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    key = new_key()
    original = Blocked(server, key, tmp_path)
    duplicate = post(server, block_path(tmp_path), key)
    assert_problem(duplicate, 409)
    assert int(duplicate.headers["retry-after"]) >= 1
    first = original.release()
    assert first.status_code == 201
    retry = post(server, block_path(tmp_path), key)
    assert retry.content == first.content
    assert retry.headers["idempotent-replayed"] == "true"
    assert payments(db) == 1


async def test_concurrent_identical_requests_execute_once(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    headers = {**ALICE, "Idempotency-Key": key}
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(client.post("/payments", json=PAYMENT, headers=headers) for _ in range(50))
        )
    assert {a.status_code for a in answers} <= {201, 409}
    created = [a for a in answers if a.status_code == 201]
    assert len({a.content for a in created}) == 1  # the original and identical replays
    assert all(a.headers["retry-after"] for a in answers if a.status_code == 409)
    assert payments(db) == 1
    assert keys(db) == 1


@pytest.mark.parametrize("path", ["/fail", "/boom"], ids=["5xx-answer", "exception"])
def test_a_server_error_is_rolled_back_and_not_stored(
    server: Server, db: psycopg.Connection[Any], path: str
) -> None:
    key = new_key()
    for _ in range(2):  # the retry runs the endpoint again: nothing was consumed
        response = post(server, path, key)
        assert response.status_code >= 500
        assert "idempotent-replayed" not in response.headers
        if path == "/fail":
            assert response.json() == {"error": "upstream down"}
    assert payments(db) == 0
    assert keys(db) == 0


def test_the_same_key_from_two_principals_never_meets(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    alice = post(server, "/payments", key, headers=ALICE)
    bob = post(server, "/payments", key, headers=BOB)
    assert alice.status_code == bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers
    assert alice.json()["id"] != bob.json()["id"]
    assert payments(db) == 2
    assert keys(db) == 2


def test_a_body_over_the_limit_is_413(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(max_request_bytes=100)
    big = {"amount": 1, "currency": "EUR", "note": "x" * 200}
    assert_problem(post(server, "/payments", new_key(), body=big), 413)
    assert keys(db) == 0
    assert payments(db) == 0


def test_an_answer_over_the_limit_is_500_and_rolled_back(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    # It cannot be stored, so it is not given out; the key stays free and the retry runs again.
    server = make_server(max_response_bytes=40)
    key = new_key()
    for _ in range(2):
        refused = assert_problem(post(server, "/payments", key), 500)
        assert refused["title"] == "Response too large to store"
    assert payments(db) == 0
    assert keys(db) == 0


def test_a_chunked_body_over_the_limit_is_413(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(max_request_bytes=100)

    def chunked() -> Any:  # no Content-Length: the limit holds on the bytes read
        yield b'{"amount": 1, "currency": "EUR", "note": "'
        yield b"x" * 200
        yield b'"}'

    response = httpx.post(
        server.url + "/payments",
        content=chunked(),
        headers={**ALICE, "Idempotency-Key": new_key(), "Content-Type": "application/json"},
    )
    assert_problem(response, 413)
    assert keys(db) == 0


def test_a_server_killed_mid_request_leaves_no_key(
    make_server: ServerFactory, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    server = make_server()
    key = new_key()
    original = Blocked(server, key, tmp_path)  # claimed, payment inserted, not committed
    server.kill()
    original.thread.join(timeout=30)
    assert original.response is None
    # PostgreSQL notices the dead client and rolls its transaction back: wait for that.
    deadline = time.monotonic() + 20
    while db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state = 'idle in transaction'"
    ).fetchone() != (0,):
        assert time.monotonic() < deadline, "the dead server's transaction never ended"
        time.sleep(0.01)
    assert keys(db) == 0
    assert payments(db) == 0
    (tmp_path / "started").unlink()
    (tmp_path / "gate").touch()  # the retry must not block
    restarted = make_server()
    retry = post(restarted, block_path(tmp_path), key)
    assert retry.status_code == 201
    again = post(restarted, block_path(tmp_path), key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == retry.content
    assert payments(db) == 1
    assert keys(db) == 1


def test_a_key_without_a_caller_is_401_never_a_500(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    # No credentials: the key scope names no caller, so nothing can be claimed. The endpoint asks
    # for the claim's transaction (/no-db) and the adapter answers 401, not the helper's 500.
    anonymous = {"Authorization": ""}
    document = assert_problem(post(server, "/no-db", new_key(), headers=anonymous), 401)
    assert document["title"] == "Authentication required"
    assert "names no caller" in document["detail"]
    # The app's own 401 comes first where the app checks credentials itself.
    assert post(server, "/payments", new_key(), headers=anonymous).status_code == 401
    assert keys(db) == 0
