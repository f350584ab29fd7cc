"""The Flask payments app of the Flask benchmark, served by gunicorn (``bench.flask_app``).

``BENCH_FLASK_VARIANT`` is ``none`` (the app alone, as a Flask app writes through a psycopg pool:
its INSERT in the transaction that ``pool.connection()`` opens and commits), ``autocommit`` (the
app alone on a pool of autocommit connections: its INSERT commits on its own, no transaction),
``pgonce`` (the same app behind :mod:`pgonce.contrib.flask`: the claim, the row and the stored
response in one transaction), ``statements`` (the same app between the key store's begin() and
commit() with none of the middleware's logic, :class:`StatementsAlone`) or ``hand`` (the
reference doing pgonce's writes itself, :mod:`bench.by_hand`); ``BENCH_HTTP_DSN`` is the
database. The view inserts one row and answers 201 with JSON, on a
``psycopg_pool.ConnectionPool`` of one connection per server thread, created as the how-to
creates it (psycopg's default connection settings) except in ``autocommit``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flask import Flask, Response, request
from psycopg_pool import ConnectionPool

import pgonce
from bench import by_hand
from pgonce import KeyStore, Replay, Won, fingerprint
from pgonce.contrib.flask import Idempotency, connection
from pgonce.contrib.wsgi import ENVIRON_KEY, IdempotentTransaction

TABLE = "bench_flask_payments"
SCOPE = "bench-flask:bench"
INSERT = (
    f"INSERT INTO {TABLE} (principal, amount, currency) VALUES ('bench', %s, %s) RETURNING id"
).encode()


def create_app() -> Flask:
    """The WSGI application for ``BENCH_FLASK_VARIANT`` (gunicorn's ``create_app()``)."""
    variant = os.environ.get("BENCH_FLASK_VARIANT", "none")
    threads = int(os.environ.get("BENCH_FLASK_THREADS", "4"))
    pool = ConnectionPool(
        os.environ["BENCH_HTTP_DSN"],
        min_size=threads,
        max_size=threads,
        kwargs={"autocommit": True} if variant == "autocommit" else {},
        open=True,
    )
    app = Flask("bench")
    if variant == "pgonce":
        Idempotency(app, pool=pool, key_scope=lambda environ: SCOPE)
    elif variant == "statements":
        app.wsgi_app = StatementsAlone(app.wsgi_app, pool)  # type: ignore[method-assign]

    def insert(conn: Any, data: dict[str, Any]) -> int:
        row = conn.execute(INSERT, (data["amount"], data["currency"])).fetchone()
        return int(row[0])

    @app.post("/payments")
    def create_payment() -> Response | tuple[dict[str, Any], int, dict[str, str]]:
        data = request.get_json()
        if variant == "hand":
            key = request.headers["Idempotency-Key"]
            with pool.connection() as conn:
                by_hand.claim(conn, SCOPE, key)
                payment = insert(conn, data)
                body = {"id": payment, "amount": data["amount"], "currency": data["currency"]}
                encoded = json.dumps(body).encode()
                by_hand.complete(conn, SCOPE, key, 201, encoded)
            return Response(encoded, 201, {"Location": f"/payments/{payment}"}, "application/json")
        if variant in ("pgonce", "statements"):
            payment = insert(connection(), data)
        else:
            # "none": BEGIN, the INSERT, and COMMIT when the block ends, as psycopg does on a
            # connection with its default settings; "autocommit": the INSERT alone.
            with pool.connection() as conn:
                payment = insert(conn, data)
        body = {"id": payment, "amount": data["amount"], "currency": data["currency"]}
        return body, 201, {"Location": f"/payments/{payment}"}

    return app


_FLOOR_FP = fingerprint("POST", "/payments", b"")


class StatementsAlone:
    """The key store's statements alone around a WSGI app: the floor of the one-transaction
    design under a WSGI server.

    The key store's two batches around the app: begin() with a fixed fingerprint, the app on the
    claim's connection (the same ``connection()`` as under the middleware), its response
    buffered, stored by commit() and sent after it; a replay sends the stored response. No key
    validation, scope, fingerprint of the request, size limits, problem answers or expiry
    header. What separates it from Flask + pgonce is the middleware's own Python; what separates
    it from Flask alone is the database work the one-transaction design needs (the claim and the
    stored response), with the least Python around the key store's calls.
    """

    def __init__(self, app: Any, pool: ConnectionPool[Any]) -> None:
        self.app = app
        self.pool = pool
        self.store = KeyStore()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        key = environ["HTTP_IDEMPOTENCY_KEY"]
        kept: list[Any] = []

        def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            kept[:] = [status, headers]
            return None

        with self.pool.connection() as conn:
            claim = self.store.begin(conn, SCOPE, key, _FLOOR_FP)
            if isinstance(claim, Won):
                environ[ENVIRON_KEY] = IdempotentTransaction(conn, claim.scope, key)
                iterable = self.app(environ, keep)
                try:
                    body = b"".join(iterable)
                finally:  # PEP 3333, as the middleware and any WSGI server do
                    close = getattr(iterable, "close", None)
                    if close is not None:
                        close()
                status, headers = kept
                answer = pgonce.Response(int(status[:3]), tuple(headers), body)
                self.store.commit(conn, claim, answer)
                start_response(status, headers)
                return [body]
        assert isinstance(claim, Replay)
        stored = claim.response
        start_response(f"{stored.status} Stored", list(stored.headers))
        return [stored.body]
