"""Payments: a Flask app whose POST /payments is safe to retry with an Idempotency-Key.

Run it under any WSGI server (PostgreSQL from ``PGONCE_DSN``, migrated with ``pgonce migrate``)::

    PGONCE_DSN=postgresql://... gunicorn --threads 8 'examples.flask_payments.app:create_app()'

    curl -X POST localhost:8000/payments -H 'Authorization: Bearer alice-token' \\
         -H 'Idempotency-Key: "order-42"' -H 'Content-Type: application/json' \\
         -d '{"amount": 1000, "currency": "EUR"}'

Send the same request again: the same 201, byte for byte, marked ``Idempotent-Replayed: true``,
and still one payment. The view inserts the payment on the claim's connection
(:func:`pgonce.contrib.flask.connection`), so the row commits with the key and the stored response.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Response, request
from psycopg_pool import ConnectionPool

from pgonce import Settings
from pgonce.contrib.flask import Idempotency, connection
from pgonce.http.problem import CONTENT_TYPE, problem_body

#: Demo credentials: bearer token -> principal. A real app asks its identity provider.
TOKENS = {"alice-token": "alice", "bob-token": "bob"}

CREATE_TABLE = b"""
CREATE TABLE IF NOT EXISTS payments (
    id         bigserial   PRIMARY KEY,
    principal  text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


def principal_of(authorization: str | None) -> str | None:
    """The principal a ``Bearer`` token names, or ``None``."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return TOKENS.get(authorization.removeprefix("Bearer "))


def key_scope(environ: dict[str, Any]) -> str | None:
    """Keys belong to the authenticated principal: alice's key never meets bob's. ``None`` (no
    valid credentials) passes the request on without a claim, and the view answers 401."""
    principal = principal_of(environ.get("HTTP_AUTHORIZATION"))
    return f"principal:{principal}" if principal else None


def problem(status: int, title: str, detail: str) -> Response:
    return Response(problem_body(status, title, detail), status=status, mimetype=CONTENT_TYPE)


def create_app(dsn: str | None = None, **idempotency: Any) -> Flask:
    """The app on ``dsn`` (default: ``PGONCE_DSN``); ``idempotency`` tunes the middleware."""
    # pool_kwargs(): 503 + Retry-After when no connection comes within a second, fast
    # reconnection after a failover, no prepared statements behind a transaction-mode pooler.
    pool = ConnectionPool(
        dsn or os.environ["PGONCE_DSN"],
        min_size=2,
        max_size=int(os.environ.get("PGONCE_POOL_SIZE", "20")),
        open=True,
        **Settings.from_env().pool_kwargs(),
    )
    with pool.connection() as conn:
        conn.execute(CREATE_TABLE)

    app = Flask("payments")
    Idempotency(app, pool=pool, key_scope=key_scope, **idempotency)
    app.extensions["payments.pool"] = pool

    @app.post("/payments")
    def create_payment() -> Response | tuple[dict[str, Any], int, dict[str, str]]:
        who = principal_of(request.headers.get("Authorization"))
        if who is None:
            return problem(401, "Unauthorized", "a valid bearer token is required")
        payment = request.get_json(silent=True)
        if (
            not isinstance(payment, dict)
            or type(payment.get("amount")) is not int
            or payment["amount"] <= 0
            or not isinstance(payment.get("currency"), str)
            or len(payment["currency"]) != 3
        ):
            # Before any query: not stored, so the corrected retry runs.
            return problem(422, "Invalid request", "the body does not describe a payment")
        # connection() is inside the claim's transaction: this row commits with the key.
        row = (
            connection()
            .execute(
                b"INSERT INTO payments (principal, amount, currency) VALUES (%s, %s, %s)"
                b" RETURNING id, created_at",
                (who, payment["amount"], payment["currency"]),
            )
            .fetchone()
        )
        assert row is not None
        body = {
            "id": row[0],
            "amount": payment["amount"],
            "currency": payment["currency"],
            "created_at": row[1].isoformat(),
        }
        return body, 201, {"Location": f"/payments/{row[0]}"}

    @app.get("/payments/<int:payment_id>")
    def get_payment(payment_id: int) -> Response | dict[str, Any]:
        who = principal_of(request.headers.get("Authorization"))
        with pool.connection() as conn:
            row = conn.execute(
                b"SELECT id, amount, currency FROM payments WHERE id = %s AND principal = %s",
                (payment_id, who),
            ).fetchone()
        if row is None:
            return problem(404, "Not Found", "no such payment")
        return {"id": row[0], "amount": row[1], "currency": row[2]}

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    return app
