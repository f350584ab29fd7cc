"""The Flask payments app of the Flask benchmark, served by gunicorn (``bench.flask_app``).

``BENCH_FLASK_VARIANT`` is ``none`` (the app alone, as a Flask app writes through a psycopg pool:
its INSERT in the transaction that ``pool.connection()`` opens and commits), ``autocommit`` (the
app alone on a pool of autocommit connections: its INSERT commits on its own, no transaction) or
``pgonce`` (the same app behind :mod:`pgonce.contrib.flask`: the claim, the row and the stored
response in one transaction) or ``hand`` (the reference doing pgonce's writes itself,
:mod:`bench.by_hand`: the limit); ``BENCH_HTTP_DSN`` is the database. The view inserts one row and
answers 201 with JSON, on a ``psycopg_pool.ConnectionPool`` of one connection per server thread,
created as the how-to creates it (psycopg's default connection settings) except in
``autocommit``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flask import Flask, Response, request
from psycopg_pool import ConnectionPool

from bench import by_hand
from pgonce.contrib.flask import Idempotency, connection

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
        if variant == "pgonce":
            payment = insert(connection(), data)
        else:
            # "none": BEGIN, the INSERT, and COMMIT when the block ends, as psycopg does on a
            # connection with its default settings; "autocommit": the INSERT alone.
            with pool.connection() as conn:
                payment = insert(conn, data)
        body = {"id": payment, "amount": data["amount"], "currency": data["currency"]}
        return body, 201, {"Location": f"/payments/{payment}"}

    return app
