"""A Flask view under gunicorn that ends the request's transaction itself (a ``ROLLBACK`` or
``COMMIT`` in SQL, or the psycopg connection's ``rollback()`` or ``commit()``) and writes on, in
the transaction psycopg opens next. The key store's commit finds the end and rolls back what ran
after it, so the view's answer (a 201 naming a row made after the end) names a row that never
committed: it is neither sent nor stored, and the client gets the 500 problem of a transaction
ended by the endpoint, which says what became of the request. Rolled back: nothing committed, and
the retry runs the view again. Committed: the claim committed with the write before the end,
unanswered, so the retry is answered 409 (in progress) and never makes that write again.
This module is also the app: ``create_app()`` is the Flask example plus its route.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from flask import Flask, request

from examples.flask_payments import app as payments
from pgonce.contrib.flask import connection
from tests.adapters.conftest import FLASK_GUNICORN
from tests.flask.app import insert_payment
from tests.http.conftest import Server, servers_of

ARGV = (*FLASK_GUNICORN[:-1], f"{__name__}:create_app()")
ALICE = {"Authorization": "Bearer alice-token"}
BEFORE, AFTER = 1, 2  # the amounts of the payments made before and after the end


def create_app() -> Flask:
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"])

    @app.post("/end-then-write")
    def end_then_write() -> tuple[dict[str, int], int]:
        insert_payment(BEFORE)
        how = request.args["how"]
        if how in ("ROLLBACK", "COMMIT"):
            connection().execute(how.encode())
        else:
            getattr(connection(), how)()
        return {"id": insert_payment(AFTER)}, 201

    return app


@pytest.fixture
def server(dsn: str, tmp_path: Path) -> Iterator[Server]:
    with servers_of(dsn, tmp_path, ARGV) as make:
        yield make()


def committed(dsn: str) -> tuple[list[int], list[bool]]:
    """The amounts of the payments that committed, and for each key whether an answer is
    stored."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        amounts = [r[0] for r in conn.execute("SELECT amount FROM payments ORDER BY amount")]
        keys = [r[0] for r in conn.execute("SELECT response_headers IS NOT NULL FROM pgonce.keys")]
    return amounts, keys


def post(server: Server, how: str, key: str) -> httpx.Response:
    headers = {**ALICE, "Idempotency-Key": f'"{key}"'}
    return httpx.post(
        f"{server.url}/end-then-write", params={"how": how}, json={}, headers=headers, timeout=30
    )


def ended_then_wrote(server: Server, how: str, key: str, detail: str) -> dict[str, str]:
    """The first answer to a view that ended its transaction with ``how`` and wrote on: the 500
    problem of a transaction ended by the endpoint, whose detail says ``detail``, with no
    expiry (nothing stored)."""
    first = post(server, how, key)
    assert first.status_code == 500, first.text
    assert first.headers["Content-Type"] == "application/problem+json"
    problem: dict[str, str] = first.json()
    assert problem["title"] == "Transaction ended by the endpoint"
    assert detail in problem["detail"]
    assert "Idempotency-Key-Expires" not in first.headers
    return problem


@pytest.mark.parametrize("how", ["ROLLBACK", "rollback"])
def test_a_rollback_then_writes_commits_nothing_and_the_retry_runs_again(
    server: Server, dsn: str, how: str
) -> None:
    key = uuid.uuid4().hex
    problem = ended_then_wrote(server, how, key, "nothing of the request committed")
    assert committed(dsn) == ([], [])
    # The key is free: the retry runs the view again (which ends its transaction again).
    again = post(server, how, key)
    assert again.status_code == 500, again.text
    assert again.json() == problem
    assert committed(dsn) == ([], [])


@pytest.mark.parametrize("how", ["COMMIT", "commit"])
def test_a_commit_then_writes_is_never_answered_with_rows_that_were_rolled_back(
    server: Server, dsn: str, how: str
) -> None:
    key = uuid.uuid4().hex
    ended_then_wrote(server, how, key, "before its COMMIT committed")
    # The write before the end committed with the claim; the one after it did not, and no
    # answer naming it is stored.
    assert committed(dsn) == ([BEFORE], [False])
    # The claim stays in flight: the retry is told so and never makes the first write again.
    again = post(server, how, key)
    assert again.status_code == 409, again.text
    assert again.json()["title"] == "Request in progress"
    assert committed(dsn) == ([BEFORE], [False])
