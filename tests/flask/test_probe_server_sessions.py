"""Flask views on the request's SQLAlchemy ``Session`` (``EngineConnections``), under gunicorn: a
savepoint the view rolls back undoes its part only, and objects added but never flushed by the
view commit with the stored answer, once. This module is also the app (``create_app()``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from flask import Flask
from sqlalchemy import create_engine

from pgonce.contrib.flask import EngineConnections, Idempotency, session
from pgonce.contrib.wsgi import header_scope
from tests.adapters.conftest import FLASK_GUNICORN
from tests.flask.models import Base, Payment, rows
from tests.http.conftest import Server, servers_of
from tests.keys.helpers import sqlalchemy_url

ARGV = (*FLASK_GUNICORN[:-1], f"{__name__}:create_app()")


def create_app() -> Flask:
    engine = create_engine(sqlalchemy_url(os.environ["PGONCE_TEST_HTTP_DSN"]), pool_size=4)
    Base.metadata.create_all(engine)
    app = Flask(__name__)
    Idempotency(app, pool=EngineConnections(engine), key_scope=header_scope("Authorization"))

    @app.post("/nested")
    def nested() -> tuple[dict[str, int], int]:
        kept = Payment(amount=1)
        session().add(kept)
        part = session().begin_nested()
        session().add(Payment(amount=2))
        session().flush()
        part.rollback()
        session().flush()
        return {"id": kept.id}, 201

    @app.post("/unflushed")
    def unflushed() -> tuple[dict[str, str], int]:
        session().add(Payment(amount=3))  # flushed when the view returns
        return {"nonce": uuid.uuid4().hex}, 201

    @app.get("/health")
    def health() -> str:
        return "ok"

    return app


@pytest.fixture
def server(dsn: str, tmp_path: Path) -> Iterator[Server]:
    with servers_of(dsn, tmp_path, ARGV) as make:
        yield make()


def replayed(server: Server, path: str) -> httpx.Response:
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": uuid.uuid4().hex}
    first = httpx.post(server.url + path, json={}, headers=headers, timeout=30)
    assert first.status_code == 201, first.text
    again = httpx.post(server.url + path, json={}, headers=headers, timeout=30)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    return first


def test_a_savepoint_the_view_rolls_back_undoes_its_part_only(server: Server, dsn: str) -> None:
    first = replayed(server, "/nested")
    assert rows(dsn) == [(first.json()["id"], 1)]


def test_objects_the_view_never_flushed_commit_once_with_the_answer(
    server: Server, dsn: str
) -> None:
    replayed(server, "/unflushed")
    assert [amount for _, amount in rows(dsn)] == [3]
