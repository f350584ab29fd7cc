"""An endpoint under the ASGI middleware that ends the request's transaction in SQL (a ROLLBACK
or COMMIT) and writes on, on the pool's connections with autocommit off: psycopg opens a new
transaction for the later writes. commit()'s completion finds the end, and everything after it
is rolled back; the middleware then settles the claim as for an endpoint that ran nothing after
the end. Rolled back: nothing of the request committed, the client gets the "Transaction ended
by the endpoint" problem, and its retry runs the work once, whole. Committed: the claim and the
writes before the COMMIT are done and the writes after it are not; the endpoint's answer, made
after writes that were rolled back, is neither sent nor stored, the client is told what became
of the request, and the claim stays in flight (the retry gets 409, never a second run)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import psycopg
import pytest
from fastapi import FastAPI, Request
from psycopg_pool import AsyncConnectionPool

from pgonce.http import IdempotencyMiddleware, connection
from tests.http.test_ended_transactions import asgi_client


@pytest.fixture
async def client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE written (what text)")
    pool = AsyncConnectionPool(dsn, open=False, min_size=1, max_size=1)  # autocommit off
    app = FastAPI()

    @app.post("/{end}")
    async def ended(request: Request, end: str) -> dict[str, str]:
        conn = connection(request)
        await conn.execute("INSERT INTO written VALUES ('before')")
        await conn.execute(end.upper())
        await conn.execute("INSERT INTO written VALUES ('after')")
        return {"done": end}

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda scope: "s")
    async with asgi_client(wrapped, pool) as client:
        yield client


def state(dsn: str) -> tuple[list[str], list[bool]]:
    """What committed: the endpoint's writes, and for each key whether a response is stored."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        writes = [r[0] for r in conn.execute("SELECT what FROM written ORDER BY what")]
        keys = [r[0] for r in conn.execute("SELECT response_headers IS NOT NULL FROM pgonce.keys")]
    return writes, keys


async def test_a_rollback_then_writes_commit_nothing_and_the_retry_runs_once(
    client: httpx.AsyncClient, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        answer = await client.post("/rollback", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 500
    assert answer.json()["title"] == "Transaction ended by the endpoint"
    assert state(dsn) == ([], [])
    # The log names what happened, not both outcomes.
    (logged,) = [
        r.getMessage() for r in caplog.records if "ended by its endpoint" in r.getMessage()
    ]
    assert "a rollback had taken the claim" in logged
    assert "COMMIT" not in logged
    # The retry finds the key free, but the endpoint ends its transaction again: still nothing.
    again = await client.post("/rollback", headers={"Idempotency-Key": "k"})
    assert again.status_code == 500
    assert state(dsn) == ([], [])


async def test_a_commit_then_writes_keeps_the_committed_part_and_sends_no_answer(
    client: httpx.AsyncClient, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        answer = await client.post("/commit", headers={"Idempotency-Key": "k"})
    # The answer was made after the write that was rolled back (it might name its row): not
    # sent, not stored. The claim committed with the write before the COMMIT stays in flight,
    # so no retry makes that write again.
    assert answer.status_code == 500
    assert answer.json()["title"] == "Transaction ended by the endpoint"
    assert "what it wrote before its COMMIT committed" in answer.json()["detail"]
    assert state(dsn) == (["before"], [False])
    (logged,) = [
        r.getMessage() for r in caplog.records if "ended by its endpoint" in r.getMessage()
    ]
    assert "a COMMIT had committed the claim" in logged
    assert "rollback" not in logged
    retry = await client.post("/commit", headers={"Idempotency-Key": "k"})
    assert retry.status_code == 409
    assert state(dsn) == (["before"], [False])
