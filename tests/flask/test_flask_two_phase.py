"""Two-phase routes through the Flask extension: ``two_phase=[...]`` reaches the middleware, and a
view that failed after a phase is resumed by the retry after that phase."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Flask, request
from psycopg_pool import ConnectionPool

from pgonce.contrib.flask import Idempotency
from pgonce.contrib.wsgi import phased_of


def test_a_two_phase_route_resumes_after_its_last_phase_and_replays(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE charges (id serial PRIMARY KEY, key text UNIQUE)")
    app = Flask(__name__)
    failures = ["after create"]
    runs: list[str] = []

    @app.post("/charges")
    def create() -> tuple[dict[str, Any], int]:
        op = phased_of(request.environ)

        def insert(conn: psycopg.Connection[Any]) -> int:
            runs.append("create")
            row = conn.execute(
                "INSERT INTO charges (key) VALUES (%s) RETURNING id", (op.key,)
            ).fetchone()
            assert row is not None
            return int(row[0])

        charge = op.phase("create", insert)
        if failures:
            raise RuntimeError(failures.pop())
        return {"charge": charge}, 201

    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        Idempotency(app, pool=pool, key_scope=lambda environ: "tenant", two_phase=["/charges"])
        client = app.test_client()
        headers = {"Idempotency-Key": "k-1"}
        assert client.post("/charges", headers=headers).status_code == 500
        first = client.post("/charges", headers=headers)
        again = client.post("/charges", headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.data == first.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert runs == ["create"]  # the retry resumed after the phase the failed request recorded
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM charges").fetchone() == (1,)
