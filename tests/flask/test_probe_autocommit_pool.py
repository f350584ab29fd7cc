"""The middleware on a pool of autocommit connections (``kwargs={"autocommit": True}``, a common
pool setting): the claim's transaction is an explicit BEGIN, and a view (or a
``teardown_request`` function) that ends it itself must still leave the key settled, never in
flight, exactly as on a pool of ordinary connections."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from psycopg_pool import ConnectionPool

from pgonce.contrib.flask import Idempotency, connection


@pytest.fixture(params=[False, True], ids=["transactional", "autocommit"])
def pool(request: pytest.FixtureRequest, dsn: str) -> Iterator[ConnectionPool[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE things (name text)")
    kwargs = {"autocommit": request.param}
    with ConnectionPool(dsn, min_size=1, max_size=2, kwargs=kwargs, open=True) as opened:
        yield opened


def stored(dsn: str) -> tuple[list[str], list[tuple[str, int | None]]]:
    """(the things written, each key with its stored status), as another connection sees them."""
    with psycopg.connect(dsn) as conn:
        things = [row[0] for row in conn.execute("SELECT name FROM things ORDER BY name")]
        keys = conn.execute("SELECT key, response_status FROM pgonce.keys ORDER BY key").fetchall()
    return things, keys


def app_on(pool: ConnectionPool[Any]) -> Flask:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")

    @app.post("/commits")
    def commits() -> tuple[str, int]:
        connection().execute("INSERT INTO things VALUES ('committed')")
        connection().commit()  # misuse: the middleware commits once the answer is stored
        return "made", 201

    @app.post("/rolls-back")
    def rolls_back() -> tuple[str, int]:
        connection().execute("INSERT INTO things VALUES ('rolled back')")
        connection().rollback()  # misuse: the claim goes with it
        return "made", 201

    @app.post("/teardown")
    def teardown() -> tuple[str, int]:
        connection().execute("INSERT INTO things VALUES ('teardown')")
        return "made", 201

    @app.teardown_request
    def commit_when_the_request_ends(error: BaseException | None) -> None:
        if request.path == "/teardown":
            connection().commit()  # misuse, as a session-per-request habit has it

    return app


@pytest.mark.parametrize("path", ["/commits", "/teardown"])
def test_a_view_that_commits_itself_leaves_its_answer_stored_not_its_key_in_flight(
    pool: ConnectionPool[Any], dsn: str, path: str
) -> None:
    client = app_on(pool).test_client()
    first = client.post(path, headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.data) == (201, b"made")
    again = client.post(path, headers={"Idempotency-Key": "k"})
    assert (again.status_code, again.data) == (201, b"made")
    assert again.headers["Idempotent-Replayed"] == "true"
    things, keys = stored(dsn)
    assert len(things) == 1  # ran once
    assert keys == [("k", 201)]


def test_a_view_that_rolls_back_itself_leaves_its_key_free(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    client = app_on(pool).test_client()
    for _ in range(2):  # nothing was stored: the retry runs again, and is told the same
        answer = client.post("/rolls-back", headers={"Idempotency-Key": "k"})
        assert answer.status_code == 500
        assert answer.headers["Content-Type"] == "application/problem+json"
    assert stored(dsn) == ([], [])
