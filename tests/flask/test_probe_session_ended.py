"""A view with the request's ``session()`` that ends the request's transaction below SQLAlchemy
(``connection().commit()``, a ``COMMIT`` in SQL, ``connection().rollback()``).

SQLAlchemy does not see it, so its session is still active; the request must be settled as on a
plain pool: a claim the view committed gets its answer stored (the key never left in flight),
and a claim the view rolled back is answered with the problem that says nothing was done (never
the view's 201 for writes that did not commit). Only a flush that failed, which SQLAlchemy rolled
back itself, leaves the view's own answer going out unstored.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from flask import Flask
from sqlalchemy import text
from sqlalchemy.engine import Engine

from pgonce.contrib.flask import EngineConnections, Idempotency, connection, session
from tests.flask.models import Payment, rows


def keys(dsn: str) -> list[tuple[str, int | None]]:
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT key, response_status FROM pgonce.keys ORDER BY key")
        return [(row[0], row[1]) for row in found]


def app_on(engine: Engine) -> Flask:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.post("/driver-commit")
    def driver_commit() -> tuple[str, int]:
        session().add(Payment(amount=1))
        session().flush()
        connection().commit()  # misuse: below the session, which does not see it
        return "made", 201

    @app.post("/sql-commit")
    def sql_commit() -> tuple[str, int]:
        session().add(Payment(amount=2))
        session().flush()
        session().execute(text("COMMIT"))  # misuse, in SQL
        return "made", 201

    @app.post("/driver-rollback")
    def driver_rollback() -> tuple[str, int]:
        session().add(Payment(amount=3))
        session().flush()
        connection().rollback()  # misuse: the claim goes with the writes
        return "made", 201

    return app


@pytest.mark.parametrize("path", ["/driver-commit", "/sql-commit"])
def test_a_commit_below_the_session_stores_the_answer_and_frees_no_key_in_flight(
    engine: Engine, dsn: str, path: str
) -> None:
    client = app_on(engine).test_client()
    first = client.post(path, headers={"Idempotency-Key": "k"})
    assert (first.status_code, first.data) == (201, b"made")
    again = client.post(path, headers={"Idempotency-Key": "k"})
    assert (again.status_code, again.data) == (201, b"made")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(rows(dsn)) == 1  # ran once
    assert keys(dsn) == [("k", 201)]


def test_a_rollback_below_the_session_is_answered_as_nothing_done(engine: Engine, dsn: str) -> None:
    client = app_on(engine).test_client()
    for _ in range(2):  # nothing was stored: the retry runs again, and is told the same
        answer: Any = client.post("/driver-rollback", headers={"Idempotency-Key": "k"})
        assert answer.status_code == 500
        assert answer.headers["Content-Type"] == "application/problem+json"
        assert answer.json["title"] == "Transaction ended by the endpoint"
    assert rows(dsn) == []
    assert keys(dsn) == []
