"""Idempotency-Key middleware: the payments app through a real uvicorn server, with and without.

Every variant is the same FastAPI app (POST /payments inserts one row in PostgreSQL and answers
201 with JSON), served by one uvicorn process on a loopback socket, loaded by the same client at
the same concurrency, each request with a new key (the path every real request takes once):

- ``no middleware``: the reference; the endpoint inserts on a pool connection of its own, taken
  by hand, or (the reference of pgonce's FastAPI dependency) from a FastAPI dependency with
  yield, FastAPI's documented shape for a database connection;
- ``pgonce``: IdempotencyMiddleware; the endpoint inserts on the claim's connection, so the
  claim, the row and the stored response commit in one transaction. Twice: the endpoint takes the
  transaction through FastAPI's dependency (``Depends(idempotent_transaction)``), or through the
  request (``connection(request)``), which skips FastAPI's dependency resolution;
- ``the key store's statements alone``: the floor of that design, a middleware with no logic of
  its own around the key store's two batches (:class:`StatementsAlone`): what the claim and the
  stored response cost in the database, without the middleware's Python. Twice, as pgonce: the
  endpoint takes the transaction through the request, or through FastAPI's dependency (the
  limit of the database-cost target on the middleware's throughput, which is measured in that
  shape);
- the peers a user would pick instead, wired as their documentation says:
  ``fastapi-idempotency`` (it ships only an in-process memory store), ``asgi-idempotency-header``
  (its Redis backend, Redis on 6379) and ``idemkit`` (its PostgreSQL backend, asyncpg). None of
  them can put the key and the endpoint's row in one transaction: their endpoint commits on its
  own connection.

The load generator is a small keep-alive HTTP/1.1 client on raw asyncio streams, so that it uses
a fraction of the CPU that the server does (the machine is shared by client, server and database).
Every variant's server runs for the whole measurement. Variants run in interleaved rounds, and
within a round they take turns of half a second each, so that drift on a shared machine hits all
of them alike; each variant's best round is reported. Each pgonce variant runs right next to the
reference it is compared with, every other turn and round in the opposite order, and the targets
are also judged on the median over the rounds of the two's ratio within a round: measured side
by side, the pair shares whatever slowed the machine then, where the best rounds of two variants
may come from different minutes (and the best of several noisy rounds favours the noisier
variant).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psycopg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from bench.clients import wal_position
from bench.context import BenchContext
from bench.database_cost import MIDDLEWARE
from bench.report import Table, Targets, percentile, ratio, statements_alone
from bench.servers import (
    cpu_seconds,
    database_cpu,
    database_cpu_spent,
    database_pids,
    serve_process,
)
from pgonce import AsyncKeyStore, Replay, Response, Won, fingerprint
from pgonce.http import (
    IdempotencyMiddleware,
    IdempotentTransaction,
    connection,
    idempotent_transaction,
)
from pgonce.http.replay import replay_headers
from pgonce.http.transaction import STATE_KEY

TITLE = "Idempotency-Key middleware over HTTP"

FACTORY = "bench.workloads.http_middleware:create_app"
# Each pgonce variant runs next to the reference it is compared with (see run()).
VARIANTS = (
    "pgonce-floor",
    "none",
    "pgonce-request",
    "pgonce-floor-dependency",
    "none-dependency",
    "pgonce",
    "fastapi-idempotency",
    "asgi-idempotency-header",
    "idemkit",
)
LABELS = {
    "none": "no middleware",
    "none-dependency": "no middleware, connection from a FastAPI dependency",
    "pgonce": "pgonce, FastAPI dependency",
    "pgonce-request": "pgonce, connection(request)",
    "pgonce-floor": "the key store's statements alone (no middleware logic)",
    "pgonce-floor-dependency": "the key store's statements alone, FastAPI dependency",
    "fastapi-idempotency": "fastapi-idempotency 0.1 (memory store)",
    "asgi-idempotency-header": "asgi-idempotency-header 0.2 (Redis)",
    "idemkit": "idemkit 1.0 (PostgreSQL, asyncpg)",
}
CONCURRENCY = 8
POOL_SIZE = 8
#: How long one variant runs before the next in a round: a round's load is cut into slices of
#: this length, the variants' slices interleaved.
SLICE = 0.5
TABLE = "bench_http_payments"
SCOPE_PREFIX = "bench-http:"
REDIS_URL = "redis://127.0.0.1:6379/0"
IDEMKIT_TABLE = "bench_idemkit_records"

INSERT = (
    f"INSERT INTO {TABLE} (principal, amount, currency) VALUES (%s, %s, %s) RETURNING id"
).encode()


# --- the app, one per variant (uvicorn --factory bench.workloads.http_middleware:create_app) ----


class NewPayment(BaseModel):
    amount: int
    currency: str


def create_app() -> FastAPI:
    """The payments app for ``BENCH_HTTP_VARIANT`` on ``BENCH_HTTP_DSN``."""
    variant = os.environ["BENCH_HTTP_VARIANT"]
    dsn = os.environ["BENCH_HTTP_DSN"]
    pool = AsyncConnectionPool(dsn, open=False, min_size=POOL_SIZE, max_size=POOL_SIZE)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=True)
        yield
        await pool.close()

    app = FastAPI(lifespan=lifespan)

    async def insert(conn: Any, payment: NewPayment) -> JSONResponse:
        cur = await conn.execute(INSERT, ("bench", payment.amount, payment.currency))
        row = await cur.fetchone()
        body = {"id": row[0], "amount": payment.amount, "currency": payment.currency}
        return JSONResponse(body, status_code=201, headers={"Location": f"/payments/{row[0]}"})

    if variant.startswith("pgonce"):

        def key_scope(scope: Any) -> str:
            return SCOPE_PREFIX + "bench"

        if variant.startswith("pgonce-floor"):
            app.add_middleware(StatementsAlone, pool=pool)
        else:
            app.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=key_scope)

        if variant in DEPENDENCY:

            @app.post("/payments", status_code=201)
            async def create_pgonce(
                payment: NewPayment,
                tx: Annotated[IdempotentTransaction, Depends(idempotent_transaction)],
            ) -> JSONResponse:
                return await insert(tx.connection, payment)

        else:  # the same transaction, handed over without FastAPI's dependency machinery

            @app.post("/payments", status_code=201)
            async def create_pgonce_request(payment: NewPayment, request: Request) -> JSONResponse:
                return await insert(connection(request), payment)

        return app

    if variant == "none-dependency":
        app.state.pool = pool

        @app.post("/payments", status_code=201)
        async def create_with_dependency(
            payment: NewPayment, conn: Annotated[Any, Depends(pool_connection, scope="function")]
        ) -> JSONResponse:
            return await insert(conn, payment)

        return app

    @app.post("/payments", status_code=201)
    async def create(payment: NewPayment) -> JSONResponse:
        async with pool.connection() as conn:
            return await insert(conn, payment)

    if variant == "fastapi-idempotency":
        import fastapi_idempotency

        app.add_middleware(
            fastapi_idempotency.IdempotencyMiddleware,
            store=fastapi_idempotency.MemoryStore(),
            scope=lambda request: "bench",
        )
    elif variant == "asgi-idempotency-header":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.redis import RedisBackend
        from redis.asyncio import Redis

        # Its dataclass signature types the app as Starlette's ASGIApp with MutableMapping
        # messages, which Starlette's own add_middleware typing does not accept.
        app.add_middleware(
            IdempotencyHeaderMiddleware,  # type: ignore[arg-type]
            backend=RedisBackend(Redis.from_url(REDIS_URL)),
        )
    elif variant == "idemkit":
        from idemkit import HttpConfig
        from idemkit import IdempotencyMiddleware as IdemkitMiddleware
        from idemkit.backends.postgres import PostgresBackend

        backend = PostgresBackend.from_url(
            dsn, table=IDEMKIT_TABLE, min_size=POOL_SIZE, max_size=POOL_SIZE
        )
        app.add_middleware(
            IdemkitMiddleware,
            backend=backend,
            config=HttpConfig(scope=lambda request: "bench"),
        )
    elif variant != "none":
        raise ValueError(f"unknown variant {variant!r}")
    return app


async def pool_connection(request: Request) -> AsyncIterator[Any]:
    """FastAPI's documented shape for a database connection: a dependency with yield.

    Used with the endpoint's scope (``scope="function"``), so that the transaction commits before
    the answer is sent, as pgonce's does, not after it.
    """
    async with request.app.state.pool.connection() as conn:
        yield conn


class StatementsAlone:
    """The least a middleware that commits the key with the endpoint's writes does.

    The key store's two batches around the endpoint: begin() with a fixed fingerprint, the
    endpoint on the claim's connection, its response buffered, stored by commit() and sent after
    it; a replay sends the stored response. No key validation, scope, fingerprint of the request,
    size limits, problem answers or expiry header. What separates it from IdempotencyMiddleware
    is the middleware's own Python; what separates it from no middleware is the database work
    that the one-transaction design needs (the claim and the stored response).
    """

    def __init__(
        self, app: Any, pool: AsyncConnectionPool[Any] | Any, scope: str = SCOPE_PREFIX + "floor"
    ) -> None:
        # ``pool``: anything whose ``connection()`` lends a psycopg AsyncConnection, as the
        # middleware's own ``pool`` (an AsyncConnectionPool, EngineConnections).
        self.app = app
        self.pool = pool
        self.scope = scope
        self.store = AsyncKeyStore()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        messages: list[dict[str, Any]] = []

        async def keep(message: dict[str, Any]) -> None:
            messages.append(message)

        async with self.pool.connection() as conn:
            claim = await self.store.begin(conn, self.scope, key, _FLOOR_FP)
            if isinstance(claim, Won):
                tx = IdempotentTransaction(conn, claim.scope, key)
                scope["state"] = {**(scope.get("state") or {}), STATE_KEY: tx}
                await self.app(scope, receive, keep)
                start, body = messages[0], b"".join(m.get("body", b"") for m in messages[1:])
                headers = tuple((k.decode(), v.decode()) for k, v in start["headers"])
                await self.store.commit(conn, claim, Response(start["status"], headers, body))
        if isinstance(claim, Replay):
            stored = claim.response
            messages = [
                {
                    "type": "http.response.start",
                    "status": stored.status,
                    "headers": replay_headers(stored),
                },
                {"type": "http.response.body", "body": stored.body},
            ]
        for message in messages:
            await send(message)


_FLOOR_FP = fingerprint("POST", "/payments", b"")


# --- the load generator -------------------------------------------------------------------------


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: CPU seconds spent meanwhile by the server process and by PostgreSQL's processes.
    server_cpu: float = 0.0
    database_cpu: float = 0.0
    #: WAL the server wrote meanwhile (its WAL position before and after).
    wal_bytes: int = 0

    def add(self, part: Result) -> None:
        """Count ``part`` (a slice of the same round) in this result."""
        self.latencies.extend(part.latencies)
        for status, count in part.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count
        self.seconds += part.seconds
        self.server_cpu += part.server_cpu
        self.database_cpu += part.database_cpu
        self.wal_bytes += part.wal_bytes

    def per_request_us(self, cpu: float) -> str:
        return f"{cpu / len(self.latencies) * 1e6:.0f}" if self.latencies else "-"

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


def request_bytes(port: int, key: str, amount: int) -> bytes:
    body = json.dumps({"amount": amount, "currency": "EUR"}).encode()
    head = (
        f"POST /payments HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer bench\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    headers: dict[bytes, bytes] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return status, headers, b"".join(parts)
    length = int(headers.get(b"content-length", b"0"))
    return status, headers, await reader.readexactly(length)


async def load(
    port: int | Sequence[int],
    seconds: float,
    concurrency: int = CONCURRENCY,
    *,
    count: float = math.inf,
) -> Result:
    """``concurrency`` keep-alive connections, each sending new-key POSTs back to back, for
    ``seconds`` or until ``count`` requests were sent; given several ports (one server process
    on each), the connections are dealt out over them in turn."""
    result = Result()
    stop_at = time.perf_counter() + seconds
    budget = [count]
    ports = [port] if isinstance(port, int) else list(port)

    async def client(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at and budget[0] > 0:
                budget[0] -= 1
                payload = request_bytes(port, uuid.uuid4().hex, 1000)
                started = time.perf_counter()
                writer.write(payload)
                status, _, _ = await read_response(reader)
                result.latencies.append(time.perf_counter() - started)
                result.statuses[status] = result.statuses.get(status, 0) + 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(ports[n % len(ports)]) for n in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result


async def probe(port: int) -> str:
    """Does a retry replay? Two identical requests with one key, and what came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        key = uuid.uuid4().hex
        answers = []
        for _ in range(2):
            writer.write(request_bytes(port, key, 7))
            answers.append(await read_response(reader))
    finally:
        writer.close()
    (s1, _, b1), (s2, h2, b2) = answers
    if s1 != 201:
        return f"first answer {s1}"
    if s2 == s1 and b2 == b1 and h2.get(b"idempotent-replayed") == b"true":
        return "identical replay"
    if b2 == b1:
        return f"replay {s2}, same body"
    return f"second answer {s2}, another body (ran twice)"


# --- the workload -------------------------------------------------------------------------------


def prepare(ctx: BenchContext) -> None:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY,"
            " principal text NOT NULL, amount bigint NOT NULL, currency text NOT NULL)".encode()
        )
        conn.execute(f"TRUNCATE {TABLE}".encode())
    from idemkit.backends.postgres import init_pg

    asyncio.run(init_pg(ctx.dsn, table=IDEMKIT_TABLE))
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {IDEMKIT_TABLE}".encode())


def cleanup(ctx: BenchContext) -> None:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(
            f"DELETE FROM {ctx.schema}.keys WHERE scope LIKE %s".encode(), (SCOPE_PREFIX + "%",)
        )
        conn.execute(f"TRUNCATE {TABLE}, {IDEMKIT_TABLE}".encode())


def redis_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), 1):
            return True
    except OSError:
        return False


def run(ctx: BenchContext) -> list[Table]:
    prepare(ctx)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-http-middleware.log"
    log.write_text("")
    skipped: dict[str, str] = {}
    if not redis_up():
        skipped["asgi-idempotency-header"] = "Redis is not reachable on 127.0.0.1:6379"
    variants = [v for v in VARIANTS if v not in skipped]
    rounds = ctx.pick(7, short=3, quick=1)
    seconds = ctx.seconds(5)
    slices = max(1, round(seconds / SLICE))
    runs: list[dict[str, Result]] = []
    probes: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[int, int]] = {}
        for variant in variants:
            try:
                env = {"BENCH_HTTP_VARIANT": variant, "BENCH_HTTP_DSN": ctx.dsn}
                port, pid = servers[variant] = stack.enter_context(serve_process(FACTORY, env, log))
                asyncio.run(load(port, min(1.0, seconds)))  # warm-up: pools, caches, JIT-less
            except (RuntimeError, OSError) as error:
                servers.pop(variant, None)
                skipped[variant] = f"did not run: {error}"
        database = database_pids(ctx.dsn)
        running = [v for v in variants if v in servers]
        for number in range(rounds):
            # Every other round in the opposite order, and within a round the variants take
            # turns of SLICE seconds, every other turn in the opposite order: a variant and its
            # reference run side by side, each first as often as second, and a drift or a
            # neighbour's burst lands on every variant of the round alike.
            order = running if number % 2 == 0 else running[::-1]
            runs.append({variant: Result() for variant in running})
            for turn in range(slices):
                for variant in order if turn % 2 == 0 else order[::-1]:
                    port, pid = servers[variant]
                    server_before, database_before = cpu_seconds([pid]), database_cpu(database)
                    wal_before = wal_position(ctx.dsn)
                    result = asyncio.run(load(port, seconds / slices))
                    result.server_cpu = cpu_seconds([pid]) - server_before
                    result.database_cpu = database_cpu_spent(database_before)
                    result.wal_bytes = wal_position(ctx.dsn) - wal_before
                    runs[-1][variant].add(result)
        for variant in running:
            try:
                probes[variant] = asyncio.run(probe(servers[variant][0]))
            except OSError as error:
                probes[variant] = f"did not answer: {error}"
    cleanup(ctx)
    # Each variant's best round: a neighbour's burst slows whichever variant it lands on.
    results = {
        v: max((r[v] for r in runs if v in r), key=lambda result: result.rps)
        for v in variants
        if any(v in r for r in runs)
    }

    reference = results["none"]
    table = Table(
        TITLE,
        [
            "variant",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "throughput",
            "throughput, median round",
            "p99",
            "server CPU µs/req",
            "PostgreSQL CPU µs/req",
            "WAL bytes/req",
            "answers",
            "retry",
        ],
    )
    for variant in variants:
        if variant in skipped:
            continue
        result = results[variant]
        p99 = percentile(result.latencies, 99)
        table.add(
            LABELS[variant],
            f"{result.rps:,.0f}",
            f"{percentile(result.latencies, 50) * 1000:.1f}",
            f"{p99 * 1000:.1f}",
            ratio(result.rps, reference.rps, "no middleware"),
            _share(paired(runs, variant, "none"), "no middleware"),
            ratio(p99, percentile(reference.latencies, 99), "no middleware"),
            result.per_request_us(result.server_cpu),
            result.per_request_us(result.database_cpu),
            f"{result.wal_bytes / len(result.latencies):,.0f}" if result.latencies else "-",
            ", ".join(f"{n}x{s}" for s, n in sorted(result.statuses.items())),
            probes.get(variant, "?"),
        )
    table.notes.append(
        f"One uvicorn process per variant, all running throughout, {CONCURRENCY} keep-alive "
        f"connections, a new Idempotency-Key on every request, {rounds} round(s) of {seconds:g} s "
        f"per variant, in turns of {seconds / slices:g} s interleaved across the variants, "
        f"each variant's best round reported (a neighbour's burst slows whichever variant it "
        f"lands on); 'throughput, median round' is the median over the rounds of the variant's "
        f"rate over no middleware's in the same round. Each pgonce variant runs right beside "
        f"the endpoint it is compared with, every other turn in the opposite order; pools of "
        f"{POOL_SIZE} connections. 'retry' is what a second identical request got."
    )
    table.notes.append(
        "CPU per request, over that round: the uvicorn process (the app, the middleware, "
        "the drivers), and PostgreSQL's processes (the pools' backends and the background "
        "writers). Less sensitive to the neighbours' noise than requests/s, so it shows where a "
        "variant's overhead goes; the load generator runs in the benchmark's own process."
    )
    table.notes.append(
        "pgonce's figures include what the others do not do: the claim, the payment row and the "
        "stored response commit in one transaction (one BEGIN/claim/insert/complete/COMMIT). "
        "Its two rows differ only in how the endpoint takes that transaction: FastAPI's "
        "dependency, or `connection(request)`, which FastAPI hands over without resolving "
        "a dependency."
    )
    table.notes.append(
        statements_alone(
            "an ASGI middleware",
            "the endpoint between the key store's begin() and commit(), the floor of the "
            "one-transaction design",
            "no middleware",
            "pgonce",
        )
        + " Its two rows, as pgonce's, differ only in how the endpoint takes the transaction: "
        "`connection(request)`, or FastAPI's dependency."
    )
    table.notes.append(
        f"uvicorn's own choices here: HTTP/1.1 by {_installed('httptools', 'h11')}, the event "
        f"loop {_installed('uvloop', 'asyncio')}'s. A faster HTTP layer shrinks every variant's "
        "server time by the same amount, so the middleware's share of what is left grows."
    )
    table.notes.append(
        "WAL bytes per request: the server's WAL position before and after the round (any other "
        "writer's share included)."
    )
    for variant, reason in skipped.items():
        table.notes.append(f"{LABELS[variant]} skipped: {reason}.")
    _database_cost(results, runs)
    return [table, _targets(results, runs)]


def _database_cost(results: dict[str, Result], runs: list[dict[str, Result]]) -> None:
    """The middleware's figures for the key store's "database cost per request" tables: pgonce
    (FastAPI dependency) and the same app without it, each over its best round; and the limit
    of its throughput, the key store's statements alone in the same shape over the same app."""
    pgonce, bare = results.get("pgonce"), results.get("none-dependency")
    if not (pgonce and bare and pgonce.latencies and bare.latencies):
        return
    MIDDLEWARE.update(
        cpu=pgonce.database_cpu / len(pgonce.latencies) * 1e6,
        cpu_bare=bare.database_cpu / len(bare.latencies) * 1e6,
        wal=pgonce.wal_bytes / len(pgonce.latencies),
        wal_bare=bare.wal_bytes / len(bare.latencies),
        best=pgonce.rps / bare.rps if bare.rps else 0.0,
    )
    if (median := paired(runs, "pgonce", "none-dependency")) is not None:
        MIDDLEWARE["median"] = median
    floor = results.get("pgonce-floor-dependency")
    if floor is not None and floor.latencies and bare.rps:
        MIDDLEWARE["limit_best"] = floor.rps / bare.rps
        if (median := paired(runs, "pgonce-floor-dependency", "none-dependency")) is not None:
            MIDDLEWARE["limit_median"] = median


def _installed(preferred: str, fallback: str) -> str:
    """What uvicorn's "auto" settings pick: ``preferred`` when it is installed."""
    return preferred if importlib.util.find_spec(preferred) else fallback


#: Each pgonce variant against the same app without the middleware: the endpoint takes its
#: connection the way it would without pgonce (a FastAPI dependency, or by hand).
WITHOUT = {"pgonce": "none-dependency", "pgonce-request": "none"}
#: The variants whose endpoint takes pgonce's transaction through FastAPI's dependency.
DEPENDENCY = ("pgonce", "pgonce-floor-dependency")


def round_ratios(runs: Sequence[Mapping[str, Result]], variant: str, reference: str) -> list[float]:
    """``variant``'s requests/s over ``reference``'s, in each round in which both ran."""
    return [
        r[variant].rps / r[reference].rps
        for r in runs
        if variant in r and reference in r and r[reference].rps > 0
    ]


def paired(runs: Sequence[Mapping[str, Result]], variant: str, reference: str) -> float | None:
    """The median over the rounds of ``variant``'s requests/s over ``reference``'s in that round.

    Each round's two figures were measured side by side, so what slowed the machine during that
    round slowed both; the median leaves out the round a burst hit only one of them. None when
    they never ran in the same round.
    """
    ratios = round_ratios(runs, variant, reference)
    return statistics.median(ratios) if ratios else None


def _share(share: float | None, name: str) -> str:
    return ratio(share, 1.0, name) if share is not None else "-"


def _targets(results: dict[str, Result], runs: list[dict[str, Result]]) -> Table:
    """The issue's targets: overhead at most 15 % against no middleware, ahead of every peer."""
    targets = Targets(
        "Idempotency-Key middleware: the issue's targets",
        "From the table above: each variant's best round, and the median round (the median over "
        "the rounds of the ratio within a round, each round's below). Each pgonce variant is "
        "compared with "
        "the same app without the middleware, whose endpoint takes its connection the same way: "
        "through a FastAPI dependency (FastAPI's documented shape, a dependency with yield), or "
        "by hand. Against the endpoint that takes a pool connection by hand, the dependency "
        "variant's figure is in the table above: there it also pays FastAPI's resolution of a "
        "dependency, which any FastAPI dependency costs. The peer figure is the fastest peer "
        "that ran.",
    )
    for variant, without in WITHOUT.items():
        if ratios := round_ratios(runs, variant, without):
            targets.table.notes.append(
                f"{LABELS[variant]} over {LABELS[without]}, round by round: "
                f"{', '.join(f'{100 * r:.0f}' for r in ratios)} %."
            )
    peers = [r.rps for v, r in results.items() if not v.startswith(("pgonce", "none"))]
    fastest_peer = max(peers, default=0.0)
    for variant, without in WITHOUT.items():
        if variant in results and without in results:
            rps = results[variant].rps
            targets.at_least(
                f"{LABELS[variant]} vs {LABELS[without]}, best rounds",
                rps / results[without].rps,
                0.85,
            )
            median = paired(runs, variant, without)
            if median is not None:
                targets.at_least(
                    f"{LABELS[variant]} vs {LABELS[without]}, median round", median, 0.85
                )
            if fastest_peer:
                targets.at_least(f"{LABELS[variant]} vs the fastest peer", rps / fastest_peer, 1.0)
    return targets.table
