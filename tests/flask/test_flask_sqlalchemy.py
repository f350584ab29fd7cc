"""Flask with SQLAlchemy (as Flask-SQLAlchemy sets it up: one Engine, ORM models): the middleware
on the engine's pool, the view's ORM writes on the claim's transaction."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from flask import Flask
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from pgonce import UsageError
from pgonce.contrib.flask import EngineConnections, Idempotency, session
from pgonce.contrib.sqlalchemy import NotPsycopgSession
from tests.flask.models import Payment, rows


def app_on(engine: Engine) -> Flask:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")

    @app.post("/payments")
    def create() -> tuple[dict[str, int], int]:
        payment = Payment(amount=250)
        session().add(payment)
        session().flush()  # the id, from the claim's transaction
        return {"id": payment.id}, 201

    @app.post("/pending")
    def pending() -> tuple[str, int]:
        session().add(Payment(amount=1))  # flushed when the view returns
        return "", 201

    @app.post("/commit")
    def commit() -> tuple[str, int]:
        session().add(Payment(amount=2))
        session().commit()  # refused: the middleware commits
        return "", 201

    return app


def test_the_orm_writes_commit_with_the_key_and_are_replayed(engine: Engine, dsn: str) -> None:
    client = app_on(engine).test_client()
    first = client.post("/payments", headers={"Idempotency-Key": "k-1"})
    again = client.post("/payments", headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 201
    assert again.data == first.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert rows(dsn) == [(first.json["id"], 250)]  # type: ignore[index]
    assert client.post("/pending", headers={"Idempotency-Key": "k-2"}).status_code == 201
    assert len(rows(dsn)) == 2


def test_the_request_session_is_closed_when_the_request_ends(engine: Engine) -> None:
    app = app_on(engine)
    closed: list[bool] = []

    @app.post("/kept")
    def kept() -> tuple[str, int]:
        opened = session()
        close = opened.close

        def counted() -> None:
            closed.append(True)
            close()

        opened.close = counted  # type: ignore[method-assign]
        opened.add(Payment(amount=3))  # flushed when the view returns
        return "", 201

    client = app.test_client()
    assert client.post("/kept", headers={"Idempotency-Key": "k-4"}).status_code == 201
    assert closed == [True]  # closed at the request's teardown


def test_a_plain_pool_app_has_no_session_to_close(dsn: str) -> None:
    from psycopg_pool import ConnectionPool

    app = Flask(__name__)
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")
    assert not app.teardown_request_funcs  # session() is refused there: no teardown per request


def test_a_session_through_another_source_is_refused_not_leaked(engine: Engine, dsn: str) -> None:
    # A source of one's own around EngineConnections: its connections are the engine's, but the
    # app was not given EngineConnections and closes no session at the request's end, so
    # session() refuses one there rather than leave it open.
    wrapped = EngineConnections(engine)

    class Wrapper:
        def connection(self) -> Any:
            return wrapped.connection()

    app = Flask(__name__)
    Idempotency(app, pool=Wrapper(), key_scope=lambda environ: "tenant")

    @app.post("/wrapped")
    def create() -> tuple[str, int]:
        with pytest.raises(UsageError, match="EngineConnections"):
            session()
        return "", 201

    client = app.test_client()
    assert client.post("/wrapped", headers={"Idempotency-Key": "k-5"}).status_code == 201
    assert rows(dsn) == []


def test_a_session_commit_is_refused_and_nothing_commits(engine: Engine, dsn: str) -> None:
    client = app_on(engine).test_client()
    assert client.post("/commit", headers={"Idempotency-Key": "k-3"}).status_code == 500
    assert rows(dsn) == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)


def test_only_a_psycopg_engine_and_its_connections_serve_a_session(tmp_path: Any) -> None:
    with pytest.raises(NotPsycopgSession, match=r"postgresql\+psycopg://"):
        EngineConnections(create_engine(f"sqlite:///{tmp_path}/x.db"))
    with pytest.raises(UsageError, match="Engine"):
        EngineConnections("postgresql://")  # type: ignore[arg-type]
    app = Flask(__name__)
    with app.test_request_context(), pytest.raises(UsageError):
        session()


def test_a_failed_flush_caught_by_the_view_is_answered_and_not_stored(
    engine: Engine, dsn: str
) -> None:
    # SQLAlchemy rolls the request's transaction back when a flush fails (the claim with it);
    # the view answers 409 for the duplicate. That answer goes out, nothing is stored, and the
    # retry runs again: never a 500 for a transaction SQLAlchemy ended itself.
    app = app_on(engine)

    @app.post("/duplicate")
    def duplicate() -> tuple[str, int]:
        first = Payment(amount=5)
        session().add(first)
        session().flush()
        session().expunge(first)
        session().add(Payment(id=first.id, amount=6))
        try:
            session().flush()
        except IntegrityError:
            return "duplicate", 409
        return "", 201

    client = app.test_client()
    for _ in range(2):
        answer = client.post("/duplicate", headers={"Idempotency-Key": "k-dup"})
        assert answer.status_code == 409
        assert answer.data == b"duplicate"
        assert "Idempotency-Key-Expires" not in answer.headers
        assert "Idempotent-Replayed" not in answer.headers
    assert rows(dsn) == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
