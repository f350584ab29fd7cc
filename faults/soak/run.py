"""The soak run: pgonce's three paths and pgqueuer driven at a fixed offered rate through phases.

Open loop: arrivals are scheduled at ``start + k / rate`` whatever happened to the ones before
(a slow system gets a queue of requests in flight, not fewer requests). Each one's latency counts
from the moment it was sent, and the worst lag of the sending behind its schedule is reported per
phase: on a machine shared with other work the harness itself may fall behind, and that must not
be mistaken for pgonce's latency. Five paths:

- ``payments``: POST /payments on the example app with an Idempotency-Key, retried (same key)
  until its 201; latency from the schedule to the 201.
- ``webhooks``: a signed delivery to ``pgonce serve``, redelivered until its 200; latency to the
  200.
- ``inbox``: the same events' pickup: the inbox row's ``received_at`` (the storing transaction) to
  the start of the worker transaction that ran the demo handler (its row's ``recorded_at``).
- ``outbox``: an application transaction that enqueues one row; pickup from its commit to the
  broker's acknowledgement (the Redis stream entry's stamp).
- ``pgqueuer``: pgqueuer 0.x/1.x on a database of its own, a no-op job per arrival; pickup from
  the job's enqueue (its ``created``) to the start of the job.

Every completion is recorded into the phase it happened in (a latency histogram per phase and
path, and one per second for the plots); a sampler reads queue depths, table and index sizes,
dead tuples, the oldest transaction's age and the wait events once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import redis.asyncio as aioredis
from pgqueuer.db import PsycopgDriver
from pgqueuer.models import Job
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries
from psycopg_pool import AsyncConnectionPool

from faults.load import FaultLog, OutboxLoad, PaymentLoad, WebhookLoad
from faults.soak.histogram import LogHistogram
from faults.soak.phases import PHASES, FaultStats, Phase, Target, harness_connect
from pgonce.store._async.outbox import enqueue

PATHS = ("payments", "webhooks", "inbox", "outbox", "pgqueuer")
#: The paths whose latency is a pickup (commit to work started), not a request's answer.
PICKUP = {"inbox", "outbox", "pgqueuer"}
#: How often the sampler and the pickup watchers read.
SAMPLE_EVERY = 1.0
#: Arrivals in flight beyond which new ones are shed (counted, not sent): memory stays bounded
#: when a phase stalls everything.
MAX_IN_FLIGHT = 5000
#: pgqueuer: jobs a worker takes at once (its default), its workers, and how long a picked job's
#: heartbeat may be silent before another worker takes it (a worker whose connection was killed).
PGQ_BATCH = 10
PGQ_WORKERS = 2
PGQ_HEARTBEAT_TIMEOUT = 5.0


@dataclass
class PhaseRun:
    """One phase as it ran: its window, what was offered and completed, its histograms."""

    index: int
    phase: Phase
    rate: float
    began: float = 0.0
    ended: float = 0.0
    offered: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    shed: Counter[str] = field(default_factory=Counter)
    latency: dict[str, LogHistogram] = field(
        default_factory=lambda: {p: LogHistogram() for p in PATHS}
    )
    statuses: Counter[str] = field(default_factory=Counter)
    #: Per path: how far (seconds) the sending fell behind its schedule at worst.
    lag: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PATHS, 0.0))
    fault: FaultStats = field(default_factory=FaultStats)
    #: Per path: (first item number, one past the last) sent in this phase.
    items: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Outbox rows committed in this phase (their ids are the database's).
    outbox_ids: set[int] = field(default_factory=set)
    lost: Counter[str] = field(default_factory=Counter)
    doubled: Counter[str] = field(default_factory=Counter)

    @property
    def label(self) -> str:
        return f"{self.index + 1}. {self.phase.name}"

    @property
    def seconds(self) -> float:
        return max(self.ended - self.began, 1e-9)


@dataclass
class Sample:
    """One second of the run, read by the sampler."""

    at: float
    depth: dict[str, int]
    #: relation name -> (bytes, dead tuples or None for an index)
    relations: dict[str, tuple[int, int | None]]
    waits: Counter[str]
    oldest_xact_seconds: float
    p99: dict[str, float | None]


class Recorder:
    """Routes each completion to its phase and to the current second's window."""

    def __init__(self, phases: list[PhaseRun]) -> None:
        self.phases = phases
        self.current = 0
        self.window: dict[str, LogHistogram] = {p: LogHistogram() for p in PATHS}
        #: When the last phase ended, and what completed after it (while draining).
        self.closed_at: float | None = None
        self.after: dict[str, LogHistogram] = {p: LogHistogram() for p in PATHS}

    def phase_at(self, at: float) -> PhaseRun:
        for run in reversed(self.phases[: self.current + 1]):
            if run.began and at >= run.began:
                return run
        return self.phases[0]

    def record(self, path: str, seconds: float, at: float | None = None) -> None:
        when = time.time() if at is None else at
        if self.closed_at is not None and when >= self.closed_at:
            # Drained after the last phase: pickups of what was sent, in no phase's figures.
            self.after[path].record(seconds)
            return
        run = self.phase_at(when)
        run.completed[path] += 1
        run.latency[path].record(seconds)
        self.window[path].record(seconds)

    def take_window(self) -> dict[str, float | None]:
        window, self.window = self.window, {p: LogHistogram() for p in PATHS}
        return {p: h.percentile(99) for p, h in window.items()}

    @property
    def now(self) -> PhaseRun:
        return self.phases[self.current]


class OpenLoop:
    """Arrivals for one path at the current phase's rate, each its own task."""

    def __init__(
        self,
        path: str,
        base_rate: float,
        recorder: Recorder,
        send: Callable[[float], Coroutine[Any, Any, None]],
    ) -> None:
        self.path = path
        self.base_rate = base_rate
        self.recorder = recorder
        self.send = send
        self.in_flight: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        due = time.monotonic()
        while not stop.is_set():
            run = self.recorder.now
            due += 1 / (self.base_rate * run.phase.factor)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, due - time.monotonic()))
            if stop.is_set():
                break
            run.offered[self.path] += 1
            if len(self.in_flight) >= MAX_IN_FLIGHT:
                run.shed[self.path] += 1
                continue
            # Latency counts from the moment the arrival is sent; how far the sending fell behind
            # its schedule (a harness short of CPU) is reported beside it, not blamed on pgonce.
            lag = max(0.0, time.monotonic() - due)
            run.lag[self.path] = max(run.lag[self.path], lag)
            task = asyncio.create_task(self.send(time.time()))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def drain(self) -> None:
        if self.in_flight:
            await asyncio.gather(*self.in_flight, return_exceptions=True)


def _mark_items(recorder: Recorder, path: str, n: int) -> None:
    run = recorder.now
    first, _ = run.items.get(path, (n, n))
    run.items[path] = (first, n + 1)


class Paths:
    """The producers of the run and the watchers of their pickups."""

    def __init__(
        self,
        *,
        recorder: Recorder,
        hooks: WebhookLoad,
        pays: PaymentLoad,
        outbox: OutboxLoad,
        outbox_pool: AsyncConnectionPool[Any],
        pgq_pool: AsyncConnectionPool[Any],
        pgq_dsn: str,
        pgonce_dsn: str,
        redis_url: str,
    ) -> None:
        self.recorder = recorder
        self.hooks = hooks
        self.pays = pays
        self.outbox = outbox
        self.outbox_pool = outbox_pool
        self.pgq_pool = pgq_pool
        self.pgq_dsn = pgq_dsn
        self.pgonce_dsn = pgonce_dsn
        self.redis_url = redis_url
        self.client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64))
        #: Outbox row id -> wall-clock commit time, until the broker's copy is seen.
        self.outbox_commits: dict[int, float] = {}
        #: pgqueuer: item number -> commit time; runs per item number.
        self.pgq_committed: dict[int, float] = {}
        self.pgq_runs: Counter[int] = Counter()
        self.pgq_next = 0
        self.pgq_failed = 0
        self.pgq_restarts = 0

    async def payment(self, sent: float) -> None:
        n = self.pays.next
        self.pays.next += 1
        _mark_items(self.recorder, "payments", n)
        await self.pays._pay(self.client, n, time.monotonic() + 3600)
        if n in self.pays.first:
            self.recorder.record("payments", time.time() - sent)

    async def webhook(self, sent: float) -> None:
        n = self.hooks.next
        self.hooks.next += 1
        _mark_items(self.recorder, "webhooks", n)
        await self.hooks._deliver(self.client, n, time.monotonic() + 3600)
        if n in self.hooks.acked:
            self.recorder.record("webhooks", time.time() - sent)

    def statuses(self) -> Counter[str]:
        """Every answer the HTTP paths got so far, by path and status."""
        return self.pays.statuses + self.hooks.statuses

    async def outbox_row(self, sent: float) -> None:
        n = self.outbox.attempts
        while True:
            self.outbox.attempts += 1
            row_id: int | None = None
            try:
                async with self.outbox_pool.connection() as conn, conn.transaction():
                    row_id = await enqueue(conn, self.outbox.run, f"agg-{n % 20}", "tick", {"n": n})
                    # The commit starts now: noted before it, so that a relay quicker than this
                    # task's return from the commit still finds the row's time.
                    self.outbox_commits[row_id] = time.time()
            except psycopg.Error:
                # A commit whose answer was lost may or may not have happened: the database says.
                if row_id is not None:
                    self.outbox_commits.pop(row_id, None)
                self.outbox.in_doubt += 1
                await asyncio.sleep(0.05)
                continue
            assert row_id is not None
            self.outbox.committed.add(row_id)
            self.recorder.now.outbox_ids.add(row_id)
            return

    async def pgq_job(self, sent: float) -> None:
        n = self.pgq_next
        self.pgq_next += 1
        _mark_items(self.recorder, "pgqueuer", n)
        while True:
            try:
                async with self.pgq_pool.connection() as conn:
                    await Queries(PsycopgDriver(conn)).enqueue("noop", b"%d" % n)
            except psycopg.Error:
                self.pgq_failed += 1
                await asyncio.sleep(0.05)
                continue
            self.pgq_committed[n] = time.time()
            return

    async def pgq_worker(self, stop: asyncio.Event) -> None:
        """One pgqueuer QueueManager, restarted (as a supervisor would) when it dies."""
        while not stop.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.pgq_dsn, autocommit=True, connect_timeout=5
                )
            except psycopg.Error:
                await asyncio.sleep(0.2)
                continue
            manager = QueueManager(Queries(PsycopgDriver(conn)))

            @manager.entrypoint("noop")
            async def noop(job: Job) -> None:
                n = int(job.payload or b"-1")
                self.pgq_runs[n] += 1
                committed = self.pgq_committed.get(n)
                if self.pgq_runs[n] == 1 and committed is not None:
                    self.recorder.record("pgqueuer", max(0.0, time.time() - committed))

            running = asyncio.create_task(
                manager.run(
                    batch_size=PGQ_BATCH,
                    dequeue_timeout=timedelta(seconds=1),
                    heartbeat_timeout=timedelta(seconds=PGQ_HEARTBEAT_TIMEOUT),
                )
            )
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                manager.shutdown.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(running, 30)
            else:
                self.pgq_restarts += 1
                stopping.cancel()
                with contextlib.suppress(BaseException):
                    running.result()
                await asyncio.sleep(0.2)
            with contextlib.suppress(Exception):
                await conn.close()

    async def watch_inbox(self, stop: asyncio.Event) -> None:
        """Record each handled event's pickup, read from the database once a second."""
        last = 0
        query = (
            "SELECT o.id, extract(epoch FROM o.recorded_at), "
            "extract(epoch FROM o.recorded_at - i.received_at) "
            "FROM pgonce_demo.webhook_orders o JOIN pgonce.inbox i "
            "ON i.source = o.source AND i.event_id = o.event_id "
            "WHERE o.id > %s AND o.run_id = %s ORDER BY o.id"
        )
        while True:
            try:
                conn = await harness_connect(self.pgonce_dsn, autocommit=True)
                async with conn:
                    while True:
                        cur = await conn.execute(query, (last, self.hooks.run))
                        for row_id, at, pickup in await cur.fetchall():
                            last = max(last, int(row_id))
                            self.recorder.record("inbox", float(pickup), float(at))
                        if stop.is_set():
                            return
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)
            except psycopg.Error:
                await asyncio.sleep(0.2)

    async def watch_outbox(self, stop: asyncio.Event) -> None:
        client = aioredis.from_url(self.redis_url)
        last = "-"
        stream = f"outbox.{self.outbox.run}"
        try:
            while True:
                raw: Any = await client.xrange(stream, min=last, count=5000)
                for entry_id, fields in raw:
                    last = "(" + entry_id.decode()
                    row_id = int(fields[b"message-id"])
                    committed = self.outbox_commits.pop(row_id, None)
                    if committed is not None:
                        at = int(entry_id.split(b"-")[0]) / 1000
                        self.recorder.record("outbox", max(0.0, at - committed), at)
                if stop.is_set() and len(raw) < 5000:
                    return
                if len(raw) < 5000:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), SAMPLE_EVERY / 2)
        finally:
            await client.aclose()

    async def close(self) -> None:
        await self.client.aclose()


# ## The sampler

DEPTH_PGONCE = (
    "SELECT (SELECT count(*) FROM pgonce.inbox WHERE status = 'pending'), "
    "(SELECT count(*) FROM pgonce.outbox WHERE published_at IS NULL AND parked_at IS NULL)"
)
DEPTH_PGQ = "SELECT count(*) FROM pgqueuer"
#: Every table and index of a schema: its size, and a table's dead tuples (statistics views).
RELATIONS = (
    "SELECT c.relname, pg_relation_size(c.oid), s.n_dead_tup FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
    "WHERE n.nspname = %s AND c.relkind IN ('r', 'i') AND c.relname LIKE %s"
)
WAITS = (
    "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*) "
    "FROM pg_stat_activity WHERE state = 'active' AND backend_type = 'client backend' "
    "AND pid <> pg_backend_pid() GROUP BY 1"
)
OLDEST_XACT = (
    "SELECT coalesce(extract(epoch FROM max(now() - xact_start)), 0) FROM pg_stat_activity "
    "WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) AND pid <> pg_backend_pid()"
)


async def sample(
    pgonce: psycopg.AsyncConnection[Any], pgq: psycopg.AsyncConnection[Any], recorder: Recorder
) -> Sample:
    at = time.time()
    row = await (await pgonce.execute(DEPTH_PGONCE)).fetchone()
    pgq_row = await (await pgq.execute(DEPTH_PGQ)).fetchone()
    depth = {
        "inbox": int(row[0]) if row else 0,
        "outbox": int(row[1]) if row else 0,
        "pgqueuer": int(pgq_row[0]) if pgq_row else 0,
    }
    relations: dict[str, tuple[int, int | None]] = {}
    for conn, schema, like, prefix in (
        (pgonce, "pgonce", "%", "pgonce."),
        (pgq, "public", "pgqueuer%", "pgqueuer: "),
    ):
        for name, size, dead in await (await conn.execute(RELATIONS, (schema, like))).fetchall():
            relations[prefix + name] = (int(size), None if dead is None else int(dead))
    waits: Counter[str] = Counter()
    for name, count in await (await pgonce.execute(WAITS)).fetchall():
        waits[str(name)] += int(count)
    oldest = await (await pgonce.execute(OLDEST_XACT)).fetchone()
    return Sample(
        at=at,
        depth=depth,
        relations=relations,
        waits=waits,
        oldest_xact_seconds=float(oldest[0]) if oldest else 0.0,
        p99=recorder.take_window(),
    )


async def sampler(
    pgonce_dsn: str, pgq_dsn: str, recorder: Recorder, samples: list[Sample], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            a = await harness_connect(pgonce_dsn, autocommit=True)
            b = await harness_connect(pgq_dsn, autocommit=True)
            async with a, b:
                while not stop.is_set():
                    samples.append(await sample(a, b, recorder))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)
        except psycopg.Error:
            await asyncio.sleep(0.2)


def phase_runs(names: list[str], rate: float) -> list[PhaseRun]:
    return [PhaseRun(i, PHASES[name], rate * PHASES[name].factor) for i, name in enumerate(names)]


async def drive(
    phases: list[PhaseRun],
    *,
    seconds: Callable[[PhaseRun], float],
    paths: Paths,
    targets: list[Target],
    faults: FaultLog,
    samples: list[Sample],
    rate: float,
) -> None:
    """Run every phase in order with the load and the sampler running throughout."""
    recorder = paths.recorder
    stop = asyncio.Event()
    loops = [
        OpenLoop("payments", rate, recorder, paths.payment),
        OpenLoop("webhooks", rate, recorder, paths.webhook),
        OpenLoop("outbox", rate, recorder, paths.outbox_row),
        OpenLoop("pgqueuer", rate, recorder, paths.pgq_job),
    ]
    watch_stop = asyncio.Event()
    background = [
        asyncio.create_task(
            sampler(paths.pgonce_dsn, paths.pgq_dsn, recorder, samples, watch_stop)
        ),
        asyncio.create_task(paths.watch_inbox(watch_stop)),
        asyncio.create_task(paths.watch_outbox(watch_stop)),
        *(asyncio.create_task(paths.pgq_worker(watch_stop)) for _ in range(PGQ_WORKERS)),
    ]
    phases[0].began = time.time()
    producers = [asyncio.create_task(loop.run(stop)) for loop in loops]
    for index, run in enumerate(phases):
        recorder.current = index
        run.began = time.time()
        answered = paths.statuses()
        print(f"soak: phase {run.label} ({seconds(run):.0f} s) ...", flush=True)
        async with run.phase.fault(targets, run.fault, faults):
            await asyncio.sleep(seconds(run))
        run.ended = time.time()
        # The answers that came in during the phase (retries of earlier arrivals included).
        run.statuses = paths.statuses() - answered
    recorder.closed_at = phases[-1].ended
    stop.set()
    await asyncio.gather(*producers)
    for loop in loops:
        await loop.drain()
    await _settle(paths)
    watch_stop.set()
    await asyncio.gather(*background)


async def _settle(paths: Paths, within: float = 60.0) -> None:
    """Bounded wait until every acknowledged event was handled, every committed outbox row
    relayed and every committed pgqueuer job run (or ``within`` seconds passed)."""
    began = time.monotonic()
    while True:
        handled = await asyncio.to_thread(paths.hooks.handled, paths.pgonce_dsn)
        pgq_left = sum(1 for n in paths.pgq_committed if n not in paths.pgq_runs)
        waiting = {
            "events": len(paths.hooks.acked) - handled,
            "outbox rows": len(paths.outbox_commits),
            "pgqueuer jobs": pgq_left,
        }
        if not any(n > 0 for n in waiting.values()):
            print(f"soak: drained in {time.monotonic() - began:.0f} s", flush=True)
            return
        if time.monotonic() - began > within:
            print(f"soak: not drained after {within:.0f} s: {waiting}", flush=True)
            return
        await asyncio.sleep(0.5)
