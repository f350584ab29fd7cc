"""The Flask example behind pgonce's WSGI middleware under gunicorn, beyond the conformance suite.

What every adapter must do is in ``tests/adapters/``; here: waiting duplicates, what is and is not
stored, streamed and oversized responses, a database lost mid-request, and kill -9 of one worker
(gunicorn's master lives on and starts another).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg

from tests.http.conftest import Server, ServerFactory
from tests.http.test_http_middleware import (
    Blocked,
    assert_problem,
    block_path,
    keys,
    new_key,
    payments,
    post,
    waiting_duplicate,
)


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


def test_the_views_own_refusals_before_any_query_are_not_stored(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    invalid = post(server, "/payments", key, body={"amount": -1, "currency": "EUR"})
    assert_problem(invalid, 422)
    assert keys(db) == 0
    assert post(server, "/payments", key).status_code == 201  # the corrected retry runs
    unauthorized = post(server, "/payments", new_key(), headers={"Authorization": "Bearer x"})
    assert unauthorized.status_code == 401
    assert keys(db) == 1
    assert payments(db) == 1


def test_a_view_that_never_began_is_not_stored_one_that_began_is(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    first, second = post(server, "/untouched", key), post(server, "/untouched", key)
    assert first.status_code == second.status_code == 200
    assert first.json() != second.json()
    assert keys(db) == 0
    key = new_key()
    first, second = post(server, "/no-db", key), post(server, "/no-db", key)
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"


def test_a_streamed_response_is_stored_in_full_and_an_oversized_one_refused(
    make_server: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_server(max_response_bytes=4000)
    key = new_key()
    first = post(server, "/stream?chunks=30&size=100", key)
    assert first.status_code == 201
    assert len(first.content) == 3000
    second = post(server, "/stream?chunks=30&size=100", key)
    assert second.content == first.content
    assert second.headers["content-length"] == "3000"
    assert payments(db) == 1
    assert_problem(post(server, "/stream?chunks=50&size=100", new_key()), 500)
    assert payments(db) == 1  # the oversized one rolled back
    assert keys(db) == 1


def test_database_lost_mid_request_is_503_and_the_retry_pays_once(
    server: Server, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    key = new_key()
    original = Blocked(server, key, tmp_path)
    killed = db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND state = 'idle in transaction' "
        "AND pid <> pg_backend_pid()"
    ).fetchall()
    assert killed == [(True,)]
    lost = original.release()
    assert_problem(lost, 503)
    assert int(lost.headers["retry-after"]) >= 1
    assert payments(db) == 0
    for name in ("gate", "started"):
        (tmp_path / name).unlink()
    retry = Blocked(server, key, tmp_path).release()
    assert retry.status_code == 201
    assert payments(db) == 1


def test_a_worker_killed_mid_request_leaves_no_key_and_its_successor_serves_the_retry(
    server: Server, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    key = new_key()
    original = Blocked(server, key, tmp_path)  # claimed, payment inserted, not committed
    worker = int((tmp_path / "started").read_text())
    assert worker != server.process.pid  # the worker, not gunicorn's master
    os.kill(worker, signal.SIGKILL)
    original.thread.join(timeout=30)
    assert original.response is None or original.response.status_code >= 500
    deadline = time.monotonic() + 20
    while db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state = 'idle in transaction'"
    ).fetchone() != (0,):
        assert time.monotonic() < deadline, "the dead worker's transaction never ended"
        time.sleep(0.01)
    assert keys(db) == 0
    assert payments(db) == 0
    (tmp_path / "started").unlink()
    (tmp_path / "gate").touch()
    deadline = time.monotonic() + 30
    while True:  # the master starts a new worker
        try:
            retry = post(server, block_path(tmp_path), key)
            break
        except Exception:
            assert time.monotonic() < deadline, "no worker came back"
            time.sleep(0.1)
    assert retry.status_code == 201
    again = post(server, block_path(tmp_path), key)
    assert again.headers["idempotent-replayed"] == "true"
    assert payments(db) == 1
    assert keys(db) == 1
