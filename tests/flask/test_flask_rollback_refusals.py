"""A Flask (or bare WSGI) view that ends the request's transaction itself and answers: the
answer is never stored over writes that did not commit with it.

Through the request's SQLAlchemy session (``session().rollback()``, ``session().commit()``) the
end is refused: nothing of the request commits, the key stays free, the log names the typed
error and the client gets an RFC 9457 problem, not Flask's 500 page. On the psycopg connection
itself the rollback takes the claim with it: the answer goes out, not stored, and the retry runs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg_pool import ConnectionPool
from sqlalchemy.engine import Engine
from werkzeug.test import Client

from pgonce.contrib.flask import EngineConnections, Idempotency, session
from pgonce.contrib.wsgi import IdempotencyMiddleware, StartResponse, connection_of
from tests.flask.models import Payment, rows


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("action", ["rollback", "commit"])
def test_a_view_that_ends_its_sessions_transaction_gets_a_problem_and_nothing_commits(
    engine: Engine, dsn: str, action: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.post("/validate")
    def validate() -> tuple[dict[str, bool], int]:
        session().add(Payment(id=1, amount=1))
        session().flush()
        getattr(session(), action)()  # "validation failed, nothing saved" (or all saved)
        return {"saved": action == "commit"}, 200

    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        for _ in range(2):  # nothing was stored: the retry runs the view again
            refused = client.post("/validate", headers={"Idempotency-Key": "k-1"})
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert refused.json["title"] == "Transaction ended by the endpoint"  # type: ignore[index]
            assert "Idempotency-Key-Expires" not in refused.headers
    logged = [r.getMessage() for r in caplog.records if r.name == "pgonce.http"]
    refusal = "SessionRollbackRefused" if action == "rollback" else "SessionCommitRefused"
    assert len(logged) == 2
    assert all(f"{refusal}: " in message for message in logged)
    assert (rows(dsn), keys(dsn)) == ([], 0)


@pytest.mark.parametrize("action", ["rollback", "commit"])
def test_a_bare_wsgi_view_that_ends_the_transaction_never_leaves_the_key_in_flight(
    dsn: str, action: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Rolled back ("validation failed, nothing saved"): nothing committed, so the client gets
    # the problem and the retry runs. Committed: the claim committed with the write before its
    # answer was stored; the answer is stored after it, never a key in flight until it expires.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE things (name text)")

    def view(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        conn = connection_of(environ)
        conn.execute("INSERT INTO things VALUES ('made')")
        getattr(conn, action)()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"saved": action == "commit"}).encode()]

    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        client = Client(IdempotencyMiddleware(view, pool=pool, key_scope=lambda environ: "s"))
        with caplog.at_level(logging.ERROR, logger="pgonce.http"):
            first, second = (client.post("/x", headers={"Idempotency-Key": "k"}) for _ in "12")
    with psycopg.connect(dsn) as conn:
        made = conn.execute("SELECT count(*) FROM things").fetchone()
    logged = [r.getMessage() for r in caplog.records if r.name == "pgonce.http"]
    if action == "rollback":
        for answer in (first, second):  # the second ran again: the key was free
            assert answer.status_code == 500
            assert answer.headers["Content-Type"] == "application/problem+json"
            assert "Idempotency-Key-Expires" not in answer.headers
        assert (made, keys(dsn), len(logged)) == ((0,), 0, 2)
    else:
        assert first.status_code == second.status_code == 200
        assert "Idempotency-Key-Expires" in first.headers
        assert second.headers["Idempotent-Replayed"] == "true"
        assert second.get_data() == first.get_data()
        assert (made, keys(dsn), len(logged)) == ((1,), 1, 1)
    assert all("UsageError: " in message for message in logged)
