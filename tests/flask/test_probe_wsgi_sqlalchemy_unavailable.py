"""The plain WSGI middleware answers a view's database going away through SQLAlchemy with the 503.

A view that writes through a SQLAlchemy session meets a lost database as SQLAlchemy's
OperationalError and an exhausted engine pool as SQLAlchemy's TimeoutError, not psycopg's: the
middleware let them through to the server, which answered its 500, where Flask's Idempotency (and
the same failure on psycopg) gives the 503 problem with Retry-After. Served by a real WSGI server
(wsgiref's) in a thread, on a real database.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import psycopg
import pytest
from psycopg_pool import ConnectionPool
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from pgonce.contrib.wsgi import IdempotencyMiddleware, header_scope
from tests.keys.helpers import sqlalchemy_url


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    """An engine of one connection, which the view itself holds while it asks for another."""
    made = create_engine(sqlalchemy_url(dsn), pool_size=1, max_overflow=0, pool_timeout=0.1)
    yield made
    made.dispose()


def view(engine: Engine, dsn: str) -> Any:
    gone = create_engine(
        sqlalchemy_url(dsn), connect_args={"host": "127.0.0.1", "port": 1, "connect_timeout": 2}
    )

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/timeout":
            with engine.connect(), engine.connect():  # the pool's only connection, then none
                pass
        else:
            with gone.connect() as conn:  # the database is not there: OperationalError
                conn.execute(text("SELECT 1"))
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"never"]

    return app


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """``app`` served by wsgiref's server in a thread: its base URL."""
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def base_url(engine: Engine, dsn: str) -> Iterator[str]:
    with ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        app = IdempotencyMiddleware(
            view(engine, dsn), pool=pool, key_scope=header_scope("X-Api-Key")
        )
        with serve(app) as url:
            yield url


@pytest.mark.parametrize("path", ["/timeout", "/gone"])
def test_sqlalchemys_unavailable_errors_are_a_503(base_url: str, dsn: str, path: str) -> None:
    headers = {"Idempotency-Key": "k", "X-Api-Key": "shop"}
    for _ in range(2):  # nothing was stored: the retry runs again
        answer = httpx.post(base_url + path, headers=headers, content=b"{}", timeout=10)
        assert answer.status_code == 503
        assert answer.headers["Content-Type"] == "application/problem+json"
        assert "Retry-After" in answer.headers
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
