"""A view whose database went away through SQLAlchemy is answered 503, as through psycopg.

SQLAlchemy wraps psycopg's OperationalError in its own and has a pool timeout of its own
(``sqlalchemy.exc.TimeoutError``): a view on ``session()`` (or on Flask-SQLAlchemy's
``db.session``) met them as Flask's 500 page, where the same failure on a psycopg pool is
pgonce's 503 with ``Retry-After``. Nothing of the request commits and the retry runs; an
app's own handler for these errors is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import TimeoutError as PoolTimeout

from pgonce.contrib.flask import EngineConnections, Idempotency, session
from tests.flask.models import Base, Payment, rows
from tests.keys.helpers import sqlalchemy_url


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    """An engine of one connection, which the middleware holds while the view runs."""
    made = create_engine(sqlalchemy_url(dsn), pool_size=1, max_overflow=0, pool_timeout=0.1)
    Base.metadata.create_all(made)
    yield made
    made.dispose()


def add_views(app: Flask, engine: Engine) -> None:
    @app.post("/payments")
    def pay() -> tuple[str, int]:
        session().add(Payment(amount=1))
        session().flush()
        with engine.connect() as other:  # the pool is empty: SQLAlchemy's pool timeout
            other.execute(text("SELECT 1"))
        return "never", 201


def test_a_sqlalchemy_pool_timeout_in_the_view_is_a_503_and_nothing_commits(
    engine: Engine, dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")
    add_views(app, engine)
    client = app.test_client()
    for _ in range(2):  # nothing was stored: the retry runs again
        answer: Any = client.post("/payments", headers={"Idempotency-Key": "k"})
        assert answer.status_code == 503
        assert answer.headers["Content-Type"] == "application/problem+json"
        assert "Retry-After" in answer.headers
    assert rows(dsn) == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)


def test_the_apps_own_handler_of_those_errors_is_kept(engine: Engine) -> None:
    app = Flask(__name__)

    @app.errorhandler(PoolTimeout)
    def busy(error: Exception) -> tuple[str, int]:
        return "busy", 429

    Idempotency(app, pool=EngineConnections(engine), key_scope=lambda environ: "tenant")
    add_views(app, engine)
    answer = app.test_client().post("/payments", headers={"Idempotency-Key": "k"})
    assert (answer.status_code, answer.data) == (429, b"busy")
