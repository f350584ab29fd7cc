"""Webhook inbox: HTTP ingest against a bare insert endpoint, and workers against pgqueuer.

Ingest: one uvicorn process serves both the inbox receiver (``POST /webhooks/bench``: read the
body, verify its HMAC signature, claim (source, event id), store, 200 after commit) and a bare
Starlette endpoint (``POST /bare``: insert the body in a transaction of its own, 200). The same
keep-alive client loads each in turn with new, signed events; figures are requests/s and p99.

Workers: the same number of events is queued for the inbox worker (a no-op handler, run in the
transaction that marks each event done) and for pgqueuer's QueueManager (a no-op entrypoint; the
shape of pgqueuer's own ``tools/benchmark.py`` consumer, two managers), each drained to the end,
both at the same batch sizes (pgqueuer's default and the inbox's), in alternating rounds. The
headline compares them at equal batch sizes and each at its best.

Everything runs in a scratch database created for the run and dropped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from bench.context import BenchContext
from bench.report import Table, percentile, ratio
from bench.servers import serve
from bench.workloads.http_middleware import read_response
from pgonce.core.inbox import Delivery, InboxEvent, digest
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store.migrate import migrate

TITLE = "Webhook inbox"
SECRET = "bench-secret"
#: Keep-alive connections of the ingest client: a provider's burst of retries and new events.
CONCURRENCY = 32
#: Connections of the bare endpoint's pool; the receiver uses its defaults (two flushers).
BARE_POOL = 8
INGEST_SECONDS = 15.0
WORKER_EVENTS = 20_000
#: The batch sizes both consumers are measured at: pgqueuer's default (10) and the inbox
#: worker's (50). The headline compares them at the same size, and each at its best.
WORKER_BATCHES = (10, 50)


# --- the app (run in its own process) -----------------------------------------------------------


def create_app() -> Any:
    from psycopg_pool import AsyncConnectionPool
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Mount, Route

    from pgonce.webhooks.receiver import InboxReceiver
    from pgonce.webhooks.schemes import build_scheme
    from pgonce.webhooks.source import Source

    dsn = os.environ["BENCH_INBOX_DSN"]
    scheme = build_scheme(
        "generic-hmac", [SECRET], options={"header": "x-signature", "id_header": "x-event-id"}
    )
    receiver = InboxReceiver([Source(name="bench", scheme=scheme)], dsn=dsn, prefix="")
    bare_pool = AsyncConnectionPool(dsn, min_size=BARE_POOL, max_size=BARE_POOL, open=False)

    async def bare(request: Request) -> Response:
        body = await request.body()
        async with bare_pool.connection() as conn, conn.transaction():
            await conn.execute("INSERT INTO bench_bare (body) VALUES (%s)", (body,))
        return Response(b'{"outcome":"stored"}', media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await bare_pool.open(wait=True)
        async with receiver:
            yield
        await bare_pool.close()

    return Starlette(
        routes=[Route("/bare", bare, methods=["POST"]), Mount("/webhooks", receiver)],
        lifespan=lifespan,
    )


# --- ingest load --------------------------------------------------------------------------------


def signed_request(port: int, path: str) -> bytes:
    event_id = f"evt_{uuid.uuid4().hex}"
    body = json.dumps({"id": event_id, "type": "invoice.paid", "amount": 4200}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"X-Signature: {signature}\r\nX-Event-Id: {event_id}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def load(port: int, path: str, seconds: float) -> tuple[float, float, dict[int, int]]:
    """Requests/s, p99 in ms and the status counts of ``CONCURRENCY`` keep-alive clients."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                request = signed_request(port, path)
                started = time.perf_counter()
                writer.write(request)
                status, _, _ = await read_response(reader)
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, percentile(latencies, 99) * 1000, statuses


# --- workers ------------------------------------------------------------------------------------


async def _until(check: Any, every: float = 0.02) -> None:
    for _ in iter(int, 1):
        if await check():
            return
        await asyncio.sleep(every)


async def inbox_workers(
    dsn: str, schema: str, events: int, batch_size: int, run: str = "measure"
) -> float:
    """Events/s of the inbox worker draining ``events`` no-op events in batches of
    ``batch_size``."""
    from pgonce.webhooks.schemes import build_scheme
    from pgonce.webhooks.source import Source
    from pgonce.webhooks.worker import InboxWorker

    store = AsyncInboxStore(schema=schema)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for start in range(0, events, 1000):
            batch = []
            for n in range(start, min(events, start + 1000)):
                body = b'{"n":%d}' % n
                batch.append(Delivery("worker", f"{run}_{n}", body, {}, digest(body)))
            async with conn.transaction():
                await store.store(conn, batch)

    # The clock starts at the first handler call, for both consumers: start-up is not compared.
    first: list[float] = []

    async def noop(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if not first:
            first.append(time.perf_counter())

    scheme = build_scheme("generic-hmac", [SECRET], options={"header": "x-signature"})
    source = Source(name="worker", scheme=scheme, handler=noop)
    worker = InboxWorker(
        [source],
        dsn=dsn,
        schema=schema,
        batch_size=batch_size,
        poll_interval=timedelta(milliseconds=50),
    )
    query = sql.SQL(
        "SELECT count(*) FROM {}.inbox WHERE source = 'worker' AND status = 'pending'"
    ).format(sql.Identifier(schema))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher:

        async def drained() -> bool:
            row = await (await watcher.execute(query)).fetchone()
            return row is not None and row[0] == 0

        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        await _until(drained)
        elapsed = time.perf_counter() - first[0]
        stop.set()
        await running
    return events / elapsed


async def pgqueuer_workers(dsn: str, events: int, batch_size: int) -> float:
    """Jobs/s of two pgqueuer QueueManagers draining ``events`` no-op jobs."""
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        queries = Queries(PsycopgDriver(conn))
        with contextlib.suppress(psycopg.Error):
            await queries.install()
        await queries.clear_queue()
        for start in range(0, events, 1000):
            size = min(1000, events - start)
            await queries.enqueue(["noop"] * size, [b"%d" % n for n in range(size)], [0] * size)

    connections = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(2)]
    try:
        managers = [QueueManager(Queries(PsycopgDriver(c))) for c in connections]
        processed = 0
        first: list[float] = []
        finished = asyncio.Event()
        for manager in managers:

            @manager.entrypoint("noop")
            async def noop(job: Job) -> None:
                nonlocal processed
                if not first:
                    first.append(time.perf_counter())
                processed += 1
                if processed >= events:
                    finished.set()

        running = [asyncio.create_task(m.run(batch_size=batch_size)) for m in managers]
        await finished.wait()
        # pgqueuer buffers its acknowledgements: done means its queue table is empty, the way
        # the inbox's done means the events' done marks have committed.
        watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with watcher:

            async def drained() -> bool:
                row = await (await watcher.execute("SELECT count(*) FROM pgqueuer")).fetchone()
                return row is not None and row[0] == 0

            await _until(drained)
        elapsed = time.perf_counter() - first[0]
        for manager in managers:
            manager.shutdown.set()
        await asyncio.gather(*running)
    finally:
        for c in connections:
            await c.close()
    return events / elapsed


# --- the workload -------------------------------------------------------------------------------


@contextlib.contextmanager
def scratch_database(dsn: str, schema: str) -> Iterator[str]:
    name = f"pgonce_bench_inbox_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    scratch = make_conninfo(dsn, dbname=name)
    try:
        with psycopg.connect(scratch, autocommit=True) as conn:
            migrate(conn, schema)
            conn.execute("CREATE TABLE bench_bare (id bigserial PRIMARY KEY, body bytea NOT NULL)")
        yield scratch
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def run(ctx: BenchContext) -> list[Table]:
    seconds = ctx.seconds(INGEST_SECONDS)
    events = ctx.pick(WORKER_EVENTS, short=5_000, quick=1_000)
    rounds = ctx.pick(3, short=2, quick=1)
    # The server's output (warnings, a traceback if it fails to start) goes beside other temp files.
    log = Path(tempfile.gettempdir()) / "pgonce-bench-inbox-server.log"
    endpoints = {"pgonce inbox": "/webhooks/bench", "bare insert": "/bare"}
    ingest_rounds: list[dict[str, tuple[float, float, dict[int, int]]]] = []
    drain_rounds: list[dict[tuple[str, int], float]] = []
    with scratch_database(ctx.dsn, ctx.schema) as dsn:
        with serve("bench.workloads.inbox:create_app", {"BENCH_INBOX_DSN": dsn}, log) as port:
            # Warm both paths (connections, prepared statements) before measuring.
            for path in endpoints.values():
                asyncio.run(load(port, path, min(1.0, seconds)))
            # The inbox and its reference side by side, every other round in the opposite order,
            # so that drift on a shared machine hits both alike.
            for number in range(rounds):
                names = list(endpoints) if number % 2 == 0 else list(reversed(endpoints))
                ingest_rounds.append(
                    {name: asyncio.run(load(port, endpoints[name], seconds)) for name in names}
                )
        # A short warm-up run of each consumer first: connections, plans and imports are not
        # what is compared.
        asyncio.run(inbox_workers(dsn, ctx.schema, 500, WORKER_BATCHES[-1], run="warm-up"))
        asyncio.run(pgqueuer_workers(dsn, 500, WORKER_BATCHES[0]))
        consumers = [(tool, size) for size in WORKER_BATCHES for tool in ("pgonce", "pgqueuer")]
        for number in range(rounds):
            order = consumers if number % 2 == 0 else list(reversed(consumers))
            measured: dict[tuple[str, int], float] = {}
            for tool, size in order:
                tag = f"r{number}b{size}"
                measured[(tool, size)] = (
                    asyncio.run(inbox_workers(dsn, ctx.schema, events, size, run=tag))
                    if tool == "pgonce"
                    else asyncio.run(pgqueuer_workers(dsn, events, size))
                )
            drain_rounds.append(measured)
    return [
        _ingest_table(ingest_rounds, seconds),
        _drain_table(drain_rounds, events),
        _drain_headline(drain_rounds),
    ]


def _ingest_table(
    rounds: list[dict[str, tuple[float, float, dict[int, int]]]], seconds: float
) -> Table:
    best = {name: max((r[name] for r in rounds), key=lambda m: m[0]) for name in rounds[0]}
    within = sorted(r["pgonce inbox"][0] / r["bare insert"][0] for r in rounds)
    table = Table(
        "Webhook inbox: HTTP ingest (verify + dedupe + store + 200)",
        ["endpoint", "requests/s", "p99 ms", "statuses", "vs bare insert"],
    )
    for label, (rps, p99, statuses) in best.items():
        table.add(
            label, f"{rps:,.0f}", f"{p99:.1f}", statuses, ratio(rps, best["bare insert"][0], "bare")
        )
    table.notes.append(
        f"One uvicorn process serves both endpoints; {CONCURRENCY} keep-alive clients send new, "
        f"HMAC-signed events for {seconds:g} s each, in {len(rounds)} round(s) that alternate "
        "the two endpoints (every other round in the opposite order); each endpoint's best "
        f"round is reported. The inbox's rate over the bare insert's within each round: "
        + ", ".join(f"{100 * w:.0f} %" for w in within)
        + f" (median {100 * statistics.median(within):.0f} %). The bare endpoint inserts the "
        f"body in a transaction of its own from a pool of {BARE_POOL}; the inbox acknowledges "
        "only after the commit that holds the event (group commit: concurrent deliveries share "
        "it)."
    )
    return table


def _best(rounds: list[dict[tuple[str, int], float]]) -> dict[tuple[str, int], float]:
    return {key: max(r[key] for r in rounds) for key in rounds[0]}


def _drain_table(rounds: list[dict[tuple[str, int], float]], events: int) -> Table:
    best = _best(rounds)
    table = Table(
        "Webhook inbox: worker throughput with a no-op handler",
        ["consumer", "batch", "events/s", "vs pgqueuer at the same batch"],
    )
    labels = {"pgonce": "pgonce inbox worker, 2 loops", "pgqueuer": "pgqueuer, 2 QueueManagers"}
    for size in WORKER_BATCHES:
        for tool in ("pgonce", "pgqueuer"):
            rate = best[(tool, size)]
            table.add(
                labels[tool],
                size,
                f"{rate:,.0f}",
                ratio(rate, best[("pgqueuer", size)], f"pgqueuer at batch {size}"),
            )
    table.notes.append(
        f"{events:,} events queued, then drained to the end, timed from the first handler call "
        "until every event's completion has committed (the inbox's done marks; pgqueuer's "
        "buffered acknowledgements, which empty its queue table). Each consumer at each batch "
        f"size in {len(rounds)} round(s), every other round in the opposite order; the best "
        "round of each is reported. The inbox runs each handler in the transaction that marks "
        "its event done (one commit per batch; savepoints only after a failure); pgqueuer's "
        "consumer is the shape of its own tools/benchmark.py (two QueueManagers; batch 10 is "
        "its default) on psycopg."
    )
    return table


def _drain_headline(rounds: list[dict[tuple[str, int], float]]) -> Table:
    """The comparison in one line each: at equal batch sizes, and each tool at its best."""
    best = _best(rounds)
    table = Table(
        "Webhook inbox: worker throughput, the headline",
        ["comparison", "pgonce", "pgqueuer", "ratio"],
    )
    ours_best = max(WORKER_BATCHES, key=lambda b: best[("pgonce", b)])
    theirs_best = max(WORKER_BATCHES, key=lambda b: best[("pgqueuer", b)])
    pairs = [(f"same batch ({size})", size, size) for size in WORKER_BATCHES]
    pairs.append(
        (
            f"each at its best (pgonce batch {ours_best}, pgqueuer batch {theirs_best})",
            ours_best,
            theirs_best,
        )
    )
    for label, ours_size, theirs_size in pairs:
        ours, theirs = best[("pgonce", ours_size)], best[("pgqueuer", theirs_size)]
        table.add(label, f"{ours:,.0f}", f"{theirs:,.0f}", ratio(ours, theirs, "pgqueuer"))
    table.notes.append("From the table above: best rounds, events/s.")
    return table
