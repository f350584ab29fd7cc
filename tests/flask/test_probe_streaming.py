"""Streamed responses: a generator that writes through the request's connection.

Wrapped in ``stream_with_context`` it runs inside the request, before the middleware commits:
its writes commit with the claim and the whole body is stored. Not wrapped, it runs after the
view returned, outside the request: the accessors refuse with a :class:`UsageError` that says
to wrap it (not Flask's bare ``RuntimeError``), and nothing of the request commits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, Response, stream_with_context
from psycopg_pool import ConnectionPool
from sqlalchemy.engine import Engine

from pgonce import UsageError
from pgonce.contrib.flask import EngineConnections, Idempotency, connection, session


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE things (name text)")
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


def written(dsn: str) -> tuple[list[str], int]:
    """(the things written, the keys stored), as another connection sees them."""
    with psycopg.connect(dsn) as conn:
        things = [row[0] for row in conn.execute("SELECT name FROM things ORDER BY name")]
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return things, int(row[0])


def test_a_generator_in_the_request_context_writes_with_the_claim(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")

    @app.post("/report")
    def report() -> Response:
        connection().execute("INSERT INTO things VALUES ('head')")

        def parts() -> Iterator[str]:
            yield "head,"
            connection().execute("INSERT INTO things VALUES ('tail')")
            yield "tail"

        return Response(stream_with_context(parts()), status=201)

    client = app.test_client()
    first = client.post("/report", headers={"Idempotency-Key": "k"})
    again = client.post("/report", headers={"Idempotency-Key": "k"})
    assert first.status_code == again.status_code == 201
    assert first.data == again.data == b"head,tail"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert written(dsn) == (["head", "tail"], 1)


def test_a_generator_outside_the_request_is_told_to_wrap_it_and_nothing_commits(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")

    @app.post("/report")
    def report() -> Response:
        connection().execute("INSERT INTO things VALUES ('head')")

        def parts() -> Iterator[str]:
            yield "head,"
            connection().execute("INSERT INTO things VALUES ('tail')")
            yield "tail"

        return Response(parts(), status=201)

    client = app.test_client()
    for _ in range(2):  # the key stays free: the retry runs, and is told the same
        with pytest.raises(UsageError, match="stream_with_context"):
            client.post("/report", headers={"Idempotency-Key": "k"})
    assert written(dsn) == ([], 0)


def test_a_session_outside_the_request_is_a_usage_error_not_flasks(
    engine: Engine, dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.post("/report")
    def report() -> Response:
        connection()

        def parts() -> Iterator[str]:
            yield "head,"
            session()
            yield "tail"

        return Response(parts(), status=201)

    with pytest.raises(UsageError, match="stream_with_context"):
        app.test_client().post("/report", headers={"Idempotency-Key": "k"})
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
