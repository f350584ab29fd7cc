"""Two-phase keys under misuse and failure: typed errors at the call, state that counts only once
committed, the completer that keeps finishing what it can, keys freed when nothing began.

Real PostgreSQL; the clock is a parameter; concurrency waits on events.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response as StarletteResponse

from pgonce import DatabaseError, DatabaseUnavailable, LeaseLost, Response, UsageError
from pgonce.contrib import wsgi
from pgonce.core.leases import check_state
from pgonce.http import phased
from pgonce.phases import AsyncPhasedOperation, AsyncPhaseStore, PhasedOperation, PhaseStore
from pgonce.store._async.phases import complete_every
from pgonce.store.heartbeat import AsyncHeartbeat
from tests.phases.racer import FP, T0
from tests.phases.test_http import two_phase_client

PAID = Response(201, (), b"paid")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def one(conn: psycopg.Connection[Any], query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def pay(op: PhasedOperation[Any]) -> Response:
    op.phase("create", lambda conn: op.key)
    return PAID


# The completer


def test_the_completer_is_not_starved_by_requests_it_always_skips(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    for n in range(3):  # abandoned three hours ago: past max_age, left to a person
        store.start(db, "old", f"o{n}", FP, operation="pay", now=at(0))
    for n in range(3):  # an operation this completer does not run
        store.start(db, "other", f"x{n}", FP, operation="refund", now=at(0))
    store.start(db, "new", "fresh", FP, operation="pay", now=at(3 * 3600 - 120))

    done = store.complete(db, {"pay": pay}, limit=2, now=at(3 * 3600))
    assert (done.finished, done.failed) == (1, 0)
    assert one(db, "SELECT response_status FROM pgonce.keys WHERE key = 'fresh'") == 201
    assert [a.key for a in store.abandoned(db, operations=["refund"], now=at(3 * 3600))] == [
        "x0",
        "x1",
        "x2",
    ]


def test_the_completer_counts_an_answer_it_could_not_store_as_failed(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    store.start(db, "t", "k", FP, operation="pay", now=at(0))
    done = store.complete(db, {"pay": lambda op: Response(503, (), b"down")}, now=at(120))
    assert (done.finished, done.failed) == (0, 1)
    assert done.errors == ["t/k: not stored: answered 503"]


@pytest.mark.parametrize("store_server_errors", [False, True])
def test_a_provider_429_is_never_stored_and_the_next_pass_runs_again(
    db: psycopg.Connection[Any], store_server_errors: bool
) -> None:
    # A rate limit is "not now": kept, it would answer every retry with it for the key's life.
    store = PhaseStore(store_server_errors=store_server_errors)
    store.start(db, "t", "k", FP, operation="pay", now=at(0))
    limited = store.complete(db, {"pay": lambda op: Response(429, (), b"slow down")}, now=at(120))
    assert (limited.finished, limited.failed) == (0, 1)
    assert limited.errors == ["t/k: not stored: answered 429"]
    assert one(db, "SELECT response_status FROM pgonce.keys WHERE key = 'k'") is None
    paid = store.complete(db, {"pay": lambda op: Response(201, (), b"paid")}, now=at(240))
    assert (paid.finished, paid.failed) == (1, 0)
    assert one(db, "SELECT response_status FROM pgonce.keys WHERE key = 'k'") == 201


async def test_the_completer_loop_outlives_a_pool_timeout(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    failed = asyncio.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "completer pass failed" in record.getMessage():
                failed.set()

    signal = Signal()
    logging.getLogger("pgonce.completer").addHandler(signal)
    stop = asyncio.Event()
    passes: list[object] = []

    def on_run(done: object) -> None:
        passes.append(done)
        stop.set()

    try:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=1, timeout=0.2) as pool:
            async with pool.connection():  # a burst of requests holds the pool
                task = asyncio.create_task(
                    complete_every(
                        pool,
                        AsyncPhaseStore(),
                        {},
                        stop,
                        every=timedelta(milliseconds=20),
                        on_run=on_run,
                    )
                )
                waiting = asyncio.create_task(failed.wait())
                await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
            await task
    finally:
        logging.getLogger("pgonce.completer").removeHandler(signal)
    assert len(passes) == 1
    warnings = [r for r in caplog.records if "completer pass failed (" in r.getMessage()]
    assert len(warnings) == 1
    assert "tries again every" in warnings[0].getMessage()


def test_the_completer_refuses_operations_that_are_not_a_mapping(
    db: psycopg.Connection[Any],
) -> None:
    with pytest.raises(UsageError, match="maps each operation's name"):
        PhaseStore().complete(db, ["pay"])  # type: ignore[arg-type]


# State that counts only once committed


def test_a_phase_whose_commit_fails_is_not_passed(db: psycopg.Connection[Any]) -> None:
    db.execute(
        "CREATE TABLE ledger (id int, CONSTRAINT u UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    db.execute("INSERT INTO ledger VALUES (1)")
    op = PhaseStore().start(db, "t", "k", FP)
    runs: list[int] = []

    def charge(value: int) -> Any:
        def write(conn: psycopg.Connection[Any]) -> dict[str, int]:
            runs.append(value)
            conn.execute("INSERT INTO ledger VALUES (%s)", (value,))
            return {"charged": value}

        return write

    with pytest.raises(DatabaseError, match="committing a phase"):
        op.phase("charge", charge(1))  # the deferred constraint fails at COMMIT
    assert not op.reached("charge")
    assert op.point is None
    assert op.phase("charge", charge(2)) == {"charged": 2}
    assert runs == [1, 2]
    stored = one(db, "SELECT state FROM pgonce.key_leases WHERE key = 'k'")
    assert stored == {"charge": {"charged": 2}}


def test_a_lost_connection_is_database_unavailable_in_every_write(dsn: str) -> None:
    store = PhaseStore()
    with psycopg.connect(dsn, autocommit=True) as admin:
        writes: list[tuple[str, Callable[[PhasedOperation[Any]], object]]] = [
            ("phase", lambda op: op.phase("p", lambda conn: 1)),
            ("call", lambda op: op.call("p", lambda key: 1)),
            ("finish", lambda op: op.finish(PAID)),
        ]
        for name, write in writes:
            with psycopg.connect(dsn, autocommit=True) as conn:
                op = store.start(conn, "t", name, FP)
                admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                with pytest.raises(DatabaseUnavailable):
                    write(op)
                assert op.state == {}
                assert not op.stored


async def test_two_calls_at_once_on_one_operation_are_refused(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "t", "k", FP)
        inside = asyncio.Event()
        release = asyncio.Event()

        async def slow(key: str) -> str:
            inside.set()
            await release.wait()
            return "a"

        async def second() -> str:
            await inside.wait()
            try:
                return await op.call("b", lambda key: asyncio.sleep(0, "b"))
            finally:
                release.set()

        first, refused = await asyncio.gather(op.call("a", slow), second(), return_exceptions=True)
        assert first == "a"
        assert isinstance(refused, UsageError)
        assert "one phase, call or write at a time" in str(refused)
        assert await op.call("b", lambda key: asyncio.sleep(0, "b")) == "b"
        cur = await conn.execute("SELECT point, state FROM pgonce.key_leases WHERE key = 'k'")
        assert await cur.fetchone() == ("b", {"a": "a", "b": "b"})


def test_a_phase_inside_a_phase_is_refused(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)

    def outer(conn: psycopg.Connection[Any]) -> int:
        op.phase("inner", lambda c: 1)
        return 2

    with pytest.raises(UsageError, match="one phase, call or write at a time"):
        op.phase("outer", outer)
    assert op.phase("outer", lambda conn: 3) == 3


# After the answer


def test_no_write_of_a_retired_holder_is_accepted(db: psycopg.Connection[Any]) -> None:
    store = PhaseStore()
    op = store.start(db, "t", "k", FP, operation="pay", now=at(0))
    op.retire(now=at(1))
    for write in (
        lambda: op.phase("late", lambda conn: 1),
        lambda: op.fail("oops"),
        lambda: op.renew(),
        lambda: op.finish(PAID),
    ):
        with pytest.raises(UsageError, match="already finished"):
            write()
    assert not op.lost
    retired = "SELECT locked_until = 'infinity' FROM pgonce.key_leases WHERE key = 'k'"
    assert one(db, retired) is True
    # Fenced in SQL too: a holder object that missed the retirement, with its token, writes
    # nothing and cannot bring the retired row back as abandoned.
    op.stored = False
    for write in (lambda: op.renew(now=at(2)), lambda: op.fail("oops", now=at(2))):
        with pytest.raises(LeaseLost):
            write()
        op.lost = False
    assert one(db, retired) is True
    assert store.abandoned(db, now=at(10**6)) == []


def test_finishing_twice_is_a_usage_error(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)
    assert op.run(lambda o: PAID) == PAID
    with pytest.raises(UsageError, match="already finished"):
        op.finish(Response(200, (), b"again"))
    assert not op.lost


# Failures noted as the lease can store them


def test_a_work_error_with_a_nul_ends_the_lease_and_propagates(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    op = store.start(db, "t", "k", FP, now=at(0))

    def work(o: PhasedOperation[Any]) -> Response:
        raise ValueError("provider said: bad\x00byte \udcff")

    with pytest.raises(ValueError, match="provider said"):
        op.run(work, now=at(1))
    assert one(db, "SELECT last_error FROM pgonce.key_leases WHERE key = 'k'") == (
        "ValueError: provider said: bad?byte ?"
    )
    assert store.start(db, "t", "k", FP, now=at(1)).won


# The heartbeat's clock


def test_a_naive_clock_is_refused_before_the_call_runs(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)
    calls: list[str] = []
    with pytest.raises(UsageError, match="the clock's time must be timezone-aware"):
        op.call("charge", calls.append, clock=datetime.now)
    assert calls == []


async def test_a_usage_error_in_a_renewal_ends_the_heartbeat() -> None:
    renewed = asyncio.Event()
    attempts = 0

    async def renew() -> None:
        nonlocal attempts
        attempts += 1
        renewed.set()
        raise UsageError("now must be timezone-aware")

    async with AsyncHeartbeat(renew, timedelta(milliseconds=1)) as heartbeat:
        await renewed.wait()
        assert heartbeat._task is not None
        # Ends by itself (the bound only keeps a regression from hanging the suite): a broken
        # contract is not an outage to ride out.
        ended, _ = await asyncio.wait([heartbeat._task], timeout=5)
        assert ended
    assert attempts == 1
    assert isinstance(heartbeat.error, UsageError)
    assert heartbeat.failures == 0


# What a phase may record


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"amount": 1e16}, r"\['amount'\] is the float 1e\+16, which jsonb gives back as an int"),
        ({"ref": ["a\x00b"]}, r"\['ref'\]\[0\] holds a NUL character"),
        ({"\ud800": 1}, "holds a lone surrogate"),
    ],
)
def test_state_that_would_not_come_back_unchanged_is_refused(value: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_state(value, "charge")
    check_state({"amount": 12.0, "small": 1e-7, "big": 10**20}, "charge")


def test_state_nested_too_deep_is_a_usage_error() -> None:
    value: list[Any] = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(UsageError, match="nested more than"):
        check_state(value, "charge")


def test_unstorable_args_are_refused_before_the_claim(db: psycopg.Connection[Any]) -> None:
    store = PhaseStore()
    for bad in ("a\x00b", "\ud800"):
        with pytest.raises(UsageError, match="cannot be recorded"):
            store.start(db, "t", "k", FP, args={"note": bad})
    assert one(db, "SELECT count(*) FROM pgonce.keys") == 0


def test_an_unstorable_call_value_is_a_usage_error(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)
    with pytest.raises(UsageError, match="holds a NUL character"):
        op.call("charge", lambda key: {"provider_ref": "a\x00b"})
    assert op.state == {}


# Misuse


async def test_sync_work_given_to_the_async_store_is_a_usage_error(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op: AsyncPhasedOperation[Any] = await AsyncPhaseStore().start(conn, "t", "k", FP)
        with pytest.raises(UsageError, match="not an awaitable"):
            await op.phase("p", lambda c: 1)  # type: ignore[arg-type,return-value]
        with pytest.raises(UsageError, match="not an awaitable"):
            await op.call("p", lambda key: 1)  # type: ignore[arg-type,return-value]
        assert await op.phase("p", lambda c: asyncio.sleep(0, 1)) == 1


def test_async_work_given_to_the_sync_store_is_a_usage_error(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "t", "k", FP)

    async def work(conn: object) -> int:
        return 1

    with pytest.raises(UsageError, match="returned an awaitable"):
        op.phase("p", work)  # type: ignore[unused-coroutine]


def test_a_phase_on_a_failed_transaction_is_a_usage_error(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)
    with db.transaction(force_rollback=True):
        with pytest.raises(psycopg.errors.DivisionByZero):
            db.execute("SELECT 1/0")
        with pytest.raises(UsageError, match="must be idle"):
            op.phase("p", lambda conn: 1)


# Routes that refuse a request before the endpoint begins


async def test_asgi_a_request_refused_before_the_endpoint_began_frees_its_key(dsn: str) -> None:
    async def create(request: Request) -> StarletteResponse:
        if request.headers.get("authorization") != "ok":
            return JSONResponse({"error": "unauthorised"}, status_code=401)
        phased(request).key  # noqa: B018 - takes the operation: the endpoint began
        return JSONResponse({"ok": True}, status_code=201)

    async with two_phase_client(dsn, create) as client:
        headers = {"idempotency-key": "k1", "x-api-key": "shop"}
        refused = await client.post("/payments", json={}, headers=headers)
        assert refused.status_code == 401
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert one(conn, "SELECT count(*) FROM pgonce.keys") == 0
            assert one(conn, "SELECT count(*) FROM pgonce.key_leases") == 0
        again = await client.post("/payments", json={}, headers={**headers, "authorization": "ok"})
        assert again.status_code == 201


def test_wsgi_a_request_refused_before_the_view_began_frees_its_key(dsn: str) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("HTTP_AUTHORIZATION") != "ok":
            start_response("401 Unauthorized", [("content-type", "application/json")])
            return [b'{"error": "unauthorised"}']
        wsgi.phased_of(environ)
        start_response("201 Created", [("content-type", "application/json")])
        return [json.dumps({"ok": True}).encode()]

    with ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        wrapped = wsgi.IdempotencyMiddleware(
            app, pool=pool, key_scope=wsgi.header_scope("X-Api-Key"), two_phase=["/payments"]
        )
        with httpx.Client(transport=httpx.WSGITransport(app=wrapped), base_url="http://s") as http:
            headers = {"Idempotency-Key": "k1", "X-Api-Key": "shop"}
            assert http.post("/payments", json={}, headers=headers).status_code == 401
            with psycopg.connect(dsn, autocommit=True) as conn:
                assert one(conn, "SELECT count(*) FROM pgonce.keys") == 0
                assert one(conn, "SELECT count(*) FROM pgonce.key_leases") == 0
            headers["Authorization"] = "ok"
            assert http.post("/payments", json={}, headers=headers).status_code == 201


def _refusing_or_crashing(environ_auth: str | None, crash: bool) -> int:
    """What the test endpoints below do: 401 before they begin without authorization, a crash
    after they began (the third party may have been called) when asked, else 201."""
    if environ_auth != "ok":
        return 401
    if crash:
        raise RuntimeError("the process died after the provider's call")
    return 201


async def test_asgi_a_request_refused_on_a_key_taken_over_keeps_it(dsn: str) -> None:
    # An earlier request with the key began and failed: the next one takes the key over. Refused
    # before its endpoint began, it must not free the key: the earlier holder may have called the
    # third party, and a new claim by another request would hand it the same idempotency key.
    async def create(request: Request) -> StarletteResponse:
        if request.headers.get("authorization") == "ok":
            phased(request).key  # noqa: B018 - takes the operation: the endpoint began
        status = _refusing_or_crashing(
            request.headers.get("authorization"), "x-crash" in request.headers
        )
        return JSONResponse({}, status_code=status)

    async with two_phase_client(dsn, create) as client:
        headers = {"idempotency-key": "k1", "x-api-key": "shop", "authorization": "ok"}
        crashed = await client.post("/payments", json={}, headers={**headers, "x-crash": "1"})
        assert crashed.status_code == 500
        refused = await client.post("/payments", json={}, headers={**headers, "authorization": ""})
        assert refused.status_code == 401
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert one(conn, "SELECT count(*) FROM pgonce.keys") == 1
            assert one(conn, "SELECT count(*) FROM pgonce.key_leases") == 1
        again = await client.post("/payments", json={}, headers=headers)
        assert again.status_code == 201


def test_wsgi_a_request_refused_on_a_key_taken_over_keeps_it(dsn: str) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("HTTP_AUTHORIZATION") == "ok":
            wsgi.phased_of(environ)
        status = _refusing_or_crashing(environ.get("HTTP_AUTHORIZATION"), "HTTP_X_CRASH" in environ)
        start_response(f"{status} X", [("content-type", "application/json")])
        return [b"{}"]

    with ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        wrapped = wsgi.IdempotencyMiddleware(
            app, pool=pool, key_scope=wsgi.header_scope("X-Api-Key"), two_phase=["/payments"]
        )
        with httpx.Client(transport=httpx.WSGITransport(app=wrapped), base_url="http://s") as http:
            headers = {"Idempotency-Key": "k1", "X-Api-Key": "shop", "Authorization": "ok"}
            with pytest.raises(RuntimeError):  # the WSGI server's 500
                http.post("/payments", json={}, headers={**headers, "X-Crash": "1"})
            refused = http.post("/payments", json={}, headers={**headers, "Authorization": ""})
            assert refused.status_code == 401
            with psycopg.connect(dsn, autocommit=True) as conn:
                assert one(conn, "SELECT count(*) FROM pgonce.keys") == 1
                assert one(conn, "SELECT count(*) FROM pgonce.key_leases") == 1
            assert http.post("/payments", json={}, headers=headers).status_code == 201


def test_release_keeps_a_key_that_recorded_a_phase(db: psycopg.Connection[Any]) -> None:
    op = PhaseStore().start(db, "t", "k", FP)
    op.phase("create", lambda conn: 1)
    with pytest.raises(UsageError, match="resumed, not released"):
        op.release()
    assert one(db, "SELECT count(*) FROM pgonce.key_leases") == 1
