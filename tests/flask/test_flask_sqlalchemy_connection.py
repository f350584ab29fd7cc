"""Flask with SQLAlchemy: the view's ``session().connection()`` is the claim's, and its commit()
and rollback() are refused as the session's are; the writes of after_request and teardown_request
functions commit with the claim, or are refused, never dropped."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from flask import Flask
from sqlalchemy.engine import Engine

from pgonce.contrib.flask import EngineConnections, Idempotency, session
from pgonce.contrib.sqlalchemy import SessionCommitRefused, SessionRollbackRefused
from pgonce.errors import UsageError
from tests.flask.models import Payment, rows


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize(
    ("action", "refusal"), [("commit", SessionCommitRefused), ("rollback", SessionRollbackRefused)]
)
def test_the_views_commit_or_rollback_of_the_sessions_connection_is_refused(
    engine: Engine, dsn: str, action: str, refusal: type[Exception]
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")
    refused: list[Exception] = []

    @app.post("/ends")
    def ends() -> tuple[str, int]:
        session().add(Payment(id=1, amount=1))
        session().flush()
        try:
            getattr(session().connection(), action)()
        except refusal as error:
            refused.append(error)
            raise
        session().add(Payment(id=2, amount=2))  # after a commit: without the claim's answer
        return "", 201

    client = app.test_client()
    for _ in range(2):  # nothing was stored: the retry runs the view again
        assert client.post("/ends", headers={"Idempotency-Key": "k-1"}).status_code == 500
    assert len(refused) == 2
    assert (rows(dsn), keys(dsn)) == ([], 0)


def test_writes_of_after_request_and_teardown_functions_commit_with_the_claim(
    engine: Engine, dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.teardown_request
    def audit(error: BaseException | None) -> None:
        session().add(Payment(id=3, amount=3))  # runs before the app's own teardown

    @app.after_request
    def stamp(response: Any) -> Any:
        session().add(Payment(id=2, amount=2))  # after the view's flush
        return response

    @app.post("/view")
    def view() -> tuple[str, int]:
        session().add(Payment(id=1, amount=1))
        return "", 201

    @app.post("/no-session")
    def no_session() -> tuple[str, int]:
        return "", 201  # the after_request function asks for the first session

    client = app.test_client()
    assert client.post("/view", headers={"Idempotency-Key": "k-1"}).status_code == 201
    assert rows(dsn) == [(1, 1), (2, 2), (3, 3)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM orm_payments")
    replay = client.post("/view", headers={"Idempotency-Key": "k-1"})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert client.post("/no-session", headers={"Idempotency-Key": "k-2"}).status_code == 201
    assert sorted(rows(dsn)) == [(2, 2), (3, 3)]
    assert keys(dsn) == 2


def test_a_session_asked_for_after_the_requests_session_closed_is_refused(
    engine: Engine, dsn: str
) -> None:
    app = Flask(__name__)
    refused: list[UsageError] = []

    @app.teardown_request
    def late(error: BaseException | None) -> None:  # runs after the extension's teardown
        try:
            session().add(Payment(id=9, amount=9))
        except UsageError as refusal:
            refused.append(refusal)

    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.post("/view")
    def view() -> tuple[str, int]:
        session().add(Payment(id=1, amount=1))
        return "", 201

    assert app.test_client().post("/view", headers={"Idempotency-Key": "k-1"}).status_code == 201
    assert len(refused) == 1
    assert "registered before Idempotency" in str(refused[0])
    assert rows(dsn) == [(1, 1)]


def test_one_extension_on_an_engines_app_and_a_pools_app_serves_each_its_own(
    engine: Engine, dsn: str
) -> None:
    from psycopg_pool import ConnectionPool

    idempotency = Idempotency()  # an app factory's, initialized on each app it makes

    def create_app(pool: Any) -> Flask:
        app = Flask(__name__)
        idempotency.init_app(app, pool=pool, key_scope=lambda environ: "tenant")

        @app.post("/payments")
        def create() -> tuple[str, int]:
            session().add(Payment(id=1, amount=1))
            return "", 201

        return app

    on_engine = create_app(EngineConnections(engine))
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        on_pool = create_app(pool)
        headers = {"Idempotency-Key": "k-1"}
        assert on_engine.test_client().post("/payments", headers=headers).status_code == 201
        refused = on_pool.test_client().post("/payments", headers={"Idempotency-Key": "k-2"})
        assert refused.status_code == 500  # session() is refused on the pool's app
    assert rows(dsn) == [(1, 1)]
