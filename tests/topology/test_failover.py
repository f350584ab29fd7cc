"""Across a failover: a COMMIT whose answer never comes, and a node that turned read-only.

- The connection dies after the server committed and before its answer reached pgonce (a proxy
  of the suite's own holds the answer back, then cuts the connection): the outcome is unknown to
  the caller. pgonce must say so with a typed error (never success, never a generic error), and
  the client's retry with the same key must replay the stored response, not run the work again.
- A claim on a hot standby (what the old primary is once a failover demoted it, and where a DSN
  without ``target_session_attrs=read-write`` may land): a clear typed error that names the fix.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from faults.proxy import Proxy
from pgonce import KeyStore, Replay, Response, Won, fingerprint
from pgonce.errors import DatabaseError, DatabaseUnavailable
from pgonce.http import IdempotencyMiddleware
from pgonce.http.middleware import header_scope
from pgonce.http.transaction import connection
from pgonce.store.migrate import migrate
from tests.service.test_serve import start
from tests.stalling import proxy_to
from tests.topology.cluster import scratch_cluster, scratch_standby

FP = fingerprint("failover")


def _through(proxy: Proxy, dsn: str) -> str:
    return make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))


def _until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` to hold: each check is a query, so the wait follows the server."""
    for _ in range(2000):
        if condition():
            return
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def proxied(direct_dsn: str) -> Iterator[tuple[Proxy, str]]:
    with proxy_to(direct_dsn) as p:
        yield p, _through(p, direct_dsn)


def _stored(direct_dsn: str, key: str) -> bool:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT completed_at IS NOT NULL FROM pgonce.keys WHERE key = %s", (key,)
        ).fetchone()
    return row == (True,)


def _runs(direct_dsn: str) -> int:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM failover_effects").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def effects(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE failover_effects (key text)")


def _lose_the_answer_to(proxy: Proxy, direct_dsn: str, key: str, commit: Any) -> BaseException:
    """Run ``commit()``, which holds the server's answers back before its COMMIT goes out; once
    the server has committed the key, cut the connection. What ``commit()`` raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            commit()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _until(lambda: _stored(direct_dsn, key), "the server committed the key")
    finally:
        proxy.cut()
        proxy.hold(False)
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert raised, "a COMMIT whose answer never came was reported as a success"
    return raised[0]


@pytest.mark.usefixtures("effects")
def test_a_commit_whose_answer_is_lost_is_unavailable_and_the_retry_replays(
    proxied: tuple[Proxy, str], direct_dsn: str
) -> None:
    proxy, dsn = proxied
    store = KeyStore()
    conn = psycopg.connect(dsn)
    claim = store.begin(conn, "s", "lost-commit", FP)
    assert isinstance(claim, Won)
    conn.execute("INSERT INTO failover_effects VALUES ('lost-commit')")

    def commit() -> None:
        proxy.hold(True)
        store.commit(conn, claim, Response(201))

    error = _lose_the_answer_to(proxy, direct_dsn, "lost-commit", commit)
    conn.close()
    # Typed, and the one a middleware answers 503 with Retry-After: the client retries.
    assert isinstance(error, DatabaseUnavailable), repr(error)
    assert isinstance(error.__cause__, psycopg.OperationalError)

    with psycopg.connect(direct_dsn) as again:
        retry = store.begin(again, "s", "lost-commit", FP)
        assert isinstance(retry, Replay)
        assert retry.response.status == 201
    assert _runs(direct_dsn) == 1


@pytest.mark.usefixtures("effects")
def test_once_whose_commit_answer_is_lost_raises_and_the_retry_replays(
    proxied: tuple[Proxy, str], direct_dsn: str
) -> None:
    proxy, dsn = proxied
    store = KeyStore()
    conn = psycopg.connect(dsn)

    def block() -> None:
        with store.once(conn, "s", "lost-once", FP, commit=True) as op:
            assert op.won
            conn.execute("INSERT INTO failover_effects VALUES ('lost-once')")
            op.respond(Response(202, body=b"done"))
            proxy.hold(True)  # the completion and COMMIT go out on the block's exit

    error = _lose_the_answer_to(proxy, direct_dsn, "lost-once", block)
    conn.close()
    assert isinstance(error, DatabaseUnavailable), repr(error)

    with psycopg.connect(direct_dsn) as again, store.once(again, "s", "lost-once", FP) as op:
        assert op.replayed
        assert isinstance(op.claim, Replay)
        assert (op.claim.response.status, op.claim.response.body) == (202, b"done")
    assert _runs(direct_dsn) == 1


@pytest.fixture(scope="module")
def primary_and_standby() -> Iterator[tuple[str, str]]:
    """A migrated scratch primary, and a hot standby of it that has replayed the migrations."""
    with scratch_cluster() as primary:
        with psycopg.connect(primary, autocommit=True) as conn:
            migrate(conn, "pgonce")
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        with scratch_standby(primary) as standby:
            with psycopg.connect(standby, autocommit=True) as conn:

                def replayed() -> bool:
                    done = conn.execute(
                        "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0],)
                    ).fetchone()
                    return done == (True,)

                _until(replayed, "the standby replayed the migrations")
            yield primary, standby


def test_a_dsn_of_every_node_with_read_write_claims_on_the_primary(
    primary_and_standby: tuple[str, str],
) -> None:
    primary, standby = primary_and_standby
    hosts = [conninfo_to_dict(d) for d in (standby, primary)]  # the standby first
    dsn = make_conninfo(
        primary,
        host="127.0.0.1,127.0.0.1",
        port=",".join(str(h["port"]) for h in hosts),
        target_session_attrs="read-write",
    )
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        claim = store.begin(conn, "s", "routed", FP)
        assert isinstance(claim, Won)
        assert store.commit(conn, claim, Response(200))
        assert str(conn.info.port) == str(conninfo_to_dict(primary)["port"])


def test_a_claim_on_a_standby_is_a_typed_error(primary_and_standby: tuple[str, str]) -> None:
    _, standby = primary_and_standby
    store = KeyStore()
    with psycopg.connect(standby) as conn:
        with pytest.raises(DatabaseError) as raised:
            store.begin(conn, "s", "on-standby", FP)
        assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with pytest.raises(DatabaseError), store.once(conn, "s", "on-standby", FP, commit=True):
            raise AssertionError("the block ran on a standby")


def test_a_claim_on_a_standby_is_unavailable_and_names_the_fix(
    primary_and_standby: tuple[str, str],
) -> None:
    _, standby = primary_and_standby
    store = KeyStore()
    with psycopg.connect(standby) as conn, pytest.raises(DatabaseUnavailable) as raised:
        store.begin(conn, "s", "on-standby", FP)
    assert "target_session_attrs=read-write" in str(raised.value)


def _payments_app(pool: AsyncConnectionPool[Any]) -> IdempotencyMiddleware:
    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True}, status_code=201)

    return IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", endpoint, methods=["POST"])]),
        pool=pool,
        key_scope=header_scope("authorization"),
    )


async def test_the_middleware_answers_503_on_a_standby(
    primary_and_standby: tuple[str, str],
) -> None:
    _, standby = primary_and_standby
    async with AsyncConnectionPool(standby, min_size=1, max_size=1, open=False) as pool:
        app = _payments_app(pool)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"authorization": "Bearer a", "idempotency-key": "k1"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post("/pay", json={"n": 1}, headers=headers)
    assert answer.status_code == 503
    assert "retry-after" in answer.headers


@pytest.mark.usefixtures("effects")
async def test_the_middleware_answers_503_when_the_commit_answer_is_lost(
    proxied: tuple[Proxy, str], direct_dsn: str
) -> None:
    proxy, dsn = proxied
    runs: list[str] = []

    async def endpoint(request: Request) -> JSONResponse:
        await connection(request).execute("INSERT INTO failover_effects VALUES ('lost-http')")
        runs.append("ran")
        proxy.hold(True)  # the completion and COMMIT go out once the endpoint has answered
        return JSONResponse({"ok": True}, status_code=201)

    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        app = IdempotencyMiddleware(
            Starlette(routes=[Route("/pay", endpoint, methods=["POST"])]),
            pool=pool,
            key_scope=header_scope("authorization"),
        )
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"authorization": "Bearer a", "idempotency-key": "lost-http"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            request = asyncio.create_task(client.post("/pay", json={"n": 1}, headers=headers))
            try:
                for _ in range(2000):
                    if await asyncio.to_thread(_stored, direct_dsn, "lost-http"):
                        break
                else:
                    raise AssertionError("the server never committed the key")
            finally:
                proxy.cut()
                proxy.hold(False)
            answer = await request
            assert answer.status_code == 503, answer.text
            assert "retry-after" in answer.headers
            again = await client.post("/pay", json={"n": 1}, headers=headers)
    assert again.status_code == 201
    assert runs == ["ran"]
    assert _runs(direct_dsn) == 1


def test_the_service_refuses_to_start_on_a_standby(
    primary_and_standby: tuple[str, str], tmp_path: Path
) -> None:
    # Its start migrates, which a read-only node refuses: the start ends with the server's reason.
    _, standby = primary_and_standby
    with pytest.raises(AssertionError, match="in a read-only transaction"):
        start(standby, tmp_path, config='[server]\nlog_format = "json"\n').stop()


def test_readyz_is_503_once_the_address_reaches_a_standby(
    primary_and_standby: tuple[str, str], tmp_path: Path
) -> None:
    # The service's one address (a virtual IP, a DNS name, a load balancer) moves to the node a
    # failover demoted: the cut closes the pool's connections, the new ones reach the standby.
    primary, standby = primary_and_standby
    address = conninfo_to_dict(primary)
    with Proxy(tcp=("127.0.0.1", int(str(address["port"])))) as proxy:
        service = start(
            _through(proxy, primary), tmp_path, config='[server]\nlog_format = "json"\n'
        )
        try:
            assert httpx.get(f"{service.url}/readyz").status_code == 200
            proxy.tcp = ("127.0.0.1", int(str(conninfo_to_dict(standby)["port"])))
            proxy.cut()
            answers = [httpx.get(f"{service.url}/readyz") for _ in range(5)]
            assert all(a.status_code == 503 for a in answers[1:]), [a.text for a in answers]
            assert answers[-1].json()["status"] == "read-only"
            assert "target_session_attrs=read-write" in answers[-1].json()["detail"]
        finally:
            service.stop()
