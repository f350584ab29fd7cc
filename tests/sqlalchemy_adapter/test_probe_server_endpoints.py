"""FastAPI endpoints on the request's ``AsyncSession`` as teams write them, under uvicorn.

A savepoint the endpoint rolls back (``begin_nested()``), sync ORM code run with
``AsyncSession.run_sync()``, a background task that writes through the endpoint's session, the
session dependency left at FastAPI's default scope (its last flush after the answer was
captured), many response headers with bytes outside ASCII, and Starlette's ``GZipMiddleware``
outside and inside pgonce's. This module is also the app: ``create_app`` is the SQLAlchemy
example plus these endpoints, with GZipMiddleware where ``PROBE_GZIP`` says.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import psycopg
import pytest
from fastapi import BackgroundTasks, Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware

from examples.sqlalchemy_payments import app as payments
from examples.sqlalchemy_payments.app import IdempotentSession, Payment
from pgonce.contrib.sqlalchemy import idempotent_session
from tests.http.conftest import Server, ServerFactory, start_server

ARGV = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")
ALICE = {"Authorization": "Bearer alice-token"}

#: The session dependency at FastAPI's default scope (the docs ask for scope="function").
RequestScopedSession = Annotated[AsyncSession, Depends(idempotent_session)]

#: Header values outside ASCII, as bytes an ASGI app sends (obs-text, RFC 9110 section 5.5).
OBS_TEXT = bytes(range(0x80, 0x100))
MANY = 500


def _payment(principal: str) -> Payment:
    return Payment(principal=principal, amount=1, currency="EUR")


def _pay_in_sync_code(session: Session, principal: str) -> int:
    """What a team's existing sync ORM code does, run with AsyncSession.run_sync()."""
    payment = _payment(principal)
    session.add(payment)
    session.flush()
    return payment.id


def create_app() -> FastAPI:
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"])
    where = os.environ.get("PROBE_GZIP")
    if where == "outside":
        app.add_middleware(GZipMiddleware, minimum_size=100)  # added last: outermost
    elif where == "inside":
        app.user_middleware.append(Middleware(GZipMiddleware, minimum_size=100))

    @app.post("/nested", status_code=201)
    async def nested(session: IdempotentSession) -> JSONResponse:
        kept = _payment("nested-kept")
        session.add(kept)
        async with session.begin_nested() as part:
            session.add(_payment("nested-undone"))
            await session.flush()
            await part.rollback()
        await session.flush()
        return JSONResponse({"id": kept.id}, status_code=201)

    @app.post("/run-sync", status_code=201)
    async def run_sync(session: IdempotentSession) -> JSONResponse:
        payment = await session.run_sync(_pay_in_sync_code, "run-sync")
        return JSONResponse({"id": payment}, status_code=201)

    @app.post("/background", status_code=202)
    async def background(session: IdempotentSession, tasks: BackgroundTasks) -> JSONResponse:
        payment = _payment("background-first")
        session.add(payment)
        await session.flush()

        async def follow_up() -> None:
            session.add(_payment("background-task"))
            await session.flush()

        tasks.add_task(follow_up)
        return JSONResponse({"id": payment.id}, status_code=202)

    @app.post("/request-scope", status_code=201)
    async def request_scope(session: RequestScopedSession) -> JSONResponse:
        session.add(_payment("request-scope"))  # flushed by the dependency, after the answer
        return JSONResponse({"nonce": uuid.uuid4().hex}, status_code=201)

    @app.post("/headers", status_code=201)
    async def headers(session: IdempotentSession) -> Response:
        payment = _payment("headers")
        session.add(payment)
        await session.flush()
        body = json.dumps({"id": payment.id}).encode()
        raw = [(b"x-obs-text", OBS_TEXT), (b"content-type", b"application/json")]
        raw += [(f"x-header-{n}".encode(), f"value {n}".encode()) for n in range(MANY)]
        response = Response(body, status_code=201)
        response.raw_headers = [*raw, (b"content-length", str(len(body)).encode())]
        return response

    @app.post("/big", status_code=201)
    async def big(session: IdempotentSession) -> JSONResponse:
        payment = _payment("big")
        session.add(payment)
        await session.flush()
        return JSONResponse({"id": payment.id, "lines": ["line"] * 200}, status_code=201)

    return app


@pytest.fixture
def serve(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    """This module's app under uvicorn, GZipMiddleware where ``gzip`` says."""
    servers: list[Server] = []

    def start(gzip: str = "") -> Server:
        log = tmp_path / f"server-{len(servers)}.log"
        server = start_server(dsn, log, {}, ARGV, {"PROBE_GZIP": gzip})
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def post(server: Server, path: str, key: str, **headers: str) -> httpx.Response:
    sent = {**ALICE, "Idempotency-Key": key, **headers}
    return httpx.post(server.url + path, json={}, headers=sent, timeout=30)


def paid(db: psycopg.Connection[Any]) -> dict[str, int]:
    rows = db.execute("SELECT principal, count(*) FROM payments GROUP BY principal").fetchall()
    return {str(principal): int(count) for principal, count in rows}


def replays(server: Server, path: str, status: int) -> tuple[httpx.Response, httpx.Response]:
    key = uuid.uuid4().hex
    first = post(server, path, key)
    assert first.status_code == status, first.text
    assert "idempotency-key-expires" in first.headers
    again = post(server, path, key)
    assert again.status_code == status
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    return first, again


def test_a_savepoint_the_endpoint_rolls_back_undoes_its_part_only(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    replays(serve(), "/nested", 201)
    assert paid(db) == {"nested-kept": 1}


def test_sync_orm_code_run_with_run_sync_commits_once_with_the_key(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    replays(serve(), "/run-sync", 201)
    assert paid(db) == {"run-sync": 1}


def test_a_background_tasks_write_commits_with_the_key_and_never_runs_on_a_replay(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    replays(serve(), "/background", 202)
    assert paid(db) == {"background-first": 1, "background-task": 1}


def test_a_request_scoped_session_flushes_into_the_claims_commit(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    replays(serve(), "/request-scope", 201)
    assert paid(db) == {"request-scope": 1}


#: What differs between two answers by design.
_PER_ANSWER = {b"date", b"server", b"content-length", b"idempotent-replayed"}


def _kept(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(n.lower(), v) for n, v in response.headers.raw if n.lower() not in _PER_ANSWER]


def test_many_headers_with_bytes_outside_ascii_are_replayed_as_sent(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    first, again = replays(serve(), "/headers", 201)
    assert (b"x-obs-text", OBS_TEXT) in first.headers.raw
    assert _kept(again) == _kept(first)
    assert paid(db) == {"headers": 1}


def test_gzip_outside_pgonce_compresses_each_answer_for_its_client(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = serve("outside")
    key = uuid.uuid4().hex
    first = post(server, "/big", key, **{"Accept-Encoding": "gzip"})
    assert first.status_code == 201, first.text
    assert first.headers["content-encoding"] == "gzip"
    plain = post(server, "/big", key, **{"Accept-Encoding": "identity"})
    assert plain.headers["idempotent-replayed"] == "true"
    assert "content-encoding" not in plain.headers
    assert plain.content == first.content  # httpx decompressed the first
    assert paid(db) == {"big": 1}


def test_gzip_inside_pgonce_replays_the_first_clients_encoding(
    serve: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = serve("inside")
    key = uuid.uuid4().hex
    first = post(server, "/big", key, **{"Accept-Encoding": "gzip"})
    assert first.headers["content-encoding"] == "gzip"
    again = post(server, "/big", key, **{"Accept-Encoding": "identity"})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-encoding"] == "gzip"  # as the how-to says
    assert again.content == first.content
    assert paid(db) == {"big": 1}
