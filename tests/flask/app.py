"""The Flask payments example plus endpoints that misbehave on purpose (as tests/http/app.py).

Served by gunicorn in the tests (``'tests.flask.app:create_app()'``); the database comes from
``PGONCE_TEST_HTTP_DSN`` and the middleware's options from ``PGONCE_TEST_HTTP_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from flask import Flask, Response, request

from examples.flask_payments import app as payments
from pgonce import KeyStore
from pgonce.contrib.flask import connection, transaction


def middleware_options(raw: dict[str, Any]) -> dict[str, Any]:
    options = dict(raw)
    if "wait_ms" in options:
        options["wait"] = timedelta(milliseconds=options.pop("wait_ms"))
    if "store_server_errors" in options:
        options["store"] = KeyStore(store_server_errors=options.pop("store_server_errors"))
    return options


def insert_payment(amount: int = 1) -> int:
    row = (
        connection()
        .execute(
            b"INSERT INTO payments (principal, amount, currency) VALUES ('test', %s, 'EUR')"
            b" RETURNING id",
            (amount,),
        )
        .fetchone()
    )
    assert row is not None
    return int(row[0])


def create_app() -> Flask:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))

    @app.post("/boom")
    def boom() -> Response:
        insert_payment()
        raise RuntimeError("the endpoint failed after its write")

    @app.post("/fail")
    def fail() -> tuple[dict[str, str], int]:
        insert_payment()
        return {"error": "upstream down"}, 503

    @app.post("/cookie")
    def cookie() -> Response:
        payment = insert_payment()
        response = Response(json.dumps({"id": payment}), status=201, mimetype="application/json")
        response.headers["Location"] = f"/payments/{payment}"
        response.headers["X-Custom"] = "kept"
        response.set_cookie("session", "secret-session-id")
        return response

    @app.post("/stream")
    def stream() -> Response:
        chunks, size = int(request.args["chunks"]), int(request.args["size"])
        payment = insert_payment()

        def parts() -> Iterator[bytes]:
            for index in range(chunks):
                yield f"{payment}:{index}:".encode().ljust(size, b".")

        return Response(parts(), status=201, mimetype="text/plain")

    @app.post("/no-db")
    def no_db() -> tuple[dict[str, str], int]:
        transaction().begin()
        return {"nonce": uuid.uuid4().hex}, 201

    @app.post("/untouched")
    def untouched() -> tuple[dict[str, str], int]:
        return {"nonce": uuid.uuid4().hex}, 200

    @app.post("/block")
    def block() -> tuple[dict[str, Any], int]:
        # Signals "my write is done" with a file, then holds the transaction open until the test
        # creates the gate file (or kills the server). Every run leaves a line in "runs".
        payment = insert_payment()
        folder = Path(request.args["directory"])
        with (folder / "runs").open("a") as runs:
            runs.write(f"{payment}\n")
        (folder / "started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not (folder / "gate").exists():
            if time.monotonic() > deadline:
                return {"error": "gate never opened"}, 500
            time.sleep(0.01)
        return {"id": payment}, int(request.args.get("status", 201))

    return app
