"""Sweeper under load: 1,000,000 expired keys swept while claims run on a small pool.

Claims (``AsyncKeyStore.once``: claim + completion + commit, fresh keys) run without a break on a
4-connection pool, while the sweeper (default batches and pause, a connection and a process of its
own) is switched on and off in alternating phases until every expired key is gone. Each claim's
latency counts for the phase it started in, so "claim p99 alone" and "claim p99 while sweeping" come
from the same run, interleaved second by second: noise from the rest of the machine hits both alike.
The sweep's rate is reported against the rate at which one INSERT ... SELECT wrote the same rows.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg
from psycopg_pool import AsyncConnectionPool

from bench.context import BenchContext
from bench.report import Table, percentile, ratio
from pgonce import AsyncKeyStore, Response, fingerprint
from pgonce.core.retention import DEFAULT_BATCH_SIZE, DEFAULT_PAUSE, SweepLimits, format_duration
from pgonce.store._sync.sweeper import Sweeper

TITLE = "Sweeper"
ROWS = 1_000_000
QUICK_ROWS = 30_000
#: Rows for the comparison of the two join paths.
PATH_ROWS = 200_000
PATH_QUICK_ROWS = 10_000
CLIENTS = 4
#: Phases alternate: claims alone for ALONE_S seconds, then with the sweeper for SWEEP_S seconds.
ALONE_S = 1.0
SWEEP_S = 2.0
#: A run never takes longer than this, swept or not.
LIMIT_S = 480.0
# Not "bench-...": the key store workload clears those scopes when it starts, maybe mid-run.
EXPIRED_SCOPE = "sweep-bench-expired"
LIVE_SCOPE = "sweep-bench-live"
FP = fingerprint("POST", "/orders", b'{"amount": 4200}')
BODY = b'{"order":"accepted","amount":4200}'


def _fill(ctx: BenchContext, rows: int) -> float:
    """Write ``rows`` completed keys claimed 40 days ago; return the seconds it took."""
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pgonce.keys WHERE scope LIKE 'sweep-bench-%'")
        started = time.perf_counter()
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                       response_status, response_headers, response_body)
               SELECT %s, g::text, %s, now() - interval '40 days', now() - interval '40 days',
                      201, '[["content-type","application/json"]]', %s
                 FROM generate_series(1, %s) AS g""",
            (EXPIRED_SCOPE, FP, BODY, rows),
        )
        seconds = time.perf_counter() - started
        conn.execute("VACUUM ANALYZE pgonce.keys")
    return seconds


class Sweep(multiprocessing.Process):
    """The sweeper in a process of its own, as ``pgonce sweep`` (cron) or ``pgonce serve`` run it
    beside an application: running only while ``on`` is set, until drained.

    Not a thread of the benchmark's process: there it would share the claim loop's interpreter
    lock, and the claims' p99 would measure lock hand-overs in Python rather than the database.
    """

    def __init__(self, ctx: BenchContext) -> None:
        super().__init__(daemon=True)
        self.dsn = ctx.dsn
        self.schema = ctx.schema
        self.on = multiprocessing.Event()
        self.drained = multiprocessing.Event()
        self.quit = multiprocessing.Event()
        self._deleted = multiprocessing.Value("q", 0)
        self._batches = multiprocessing.Value("q", 0)
        #: Time spent inside sweep runs (batches and pauses).
        self._seconds = multiprocessing.Value("d", 0.0)

    @property
    def deleted(self) -> int:
        return int(self._deleted.value)

    @property
    def batches(self) -> int:
        return int(self._batches.value)

    @property
    def seconds(self) -> float:
        return float(self._seconds.value)

    def is_set(self) -> bool:
        # The stop signal of each run: the phase ended, or the benchmark is over.
        return not self.on.is_set() or self.quit.is_set()

    def on_batch(self, _target: str, deleted: int) -> None:
        self._deleted.value += deleted
        self._batches.value += 1

    def run(self) -> None:
        sweeper = Sweeper(schema=self.schema, limits=SweepLimits(max_batches=1_000_000))
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.quit.is_set():
                if not self.on.wait(0.05):
                    continue
                result = sweeper.sweep(conn, stop=self, on_batch=self.on_batch)
                self._seconds.value += result.seconds
                if not result.capped and all(t.ending == "drained" for t in result.targets):
                    self.drained.set()
                    return


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


async def _measure(ctx: BenchContext, sweep: Sweep) -> tuple[Phase, Phase]:
    store = AsyncKeyStore(schema=ctx.schema, wait=timedelta(seconds=2))
    run = uuid.uuid4().hex[:8]
    alone, sweeping = Phase(), Phase()
    done = asyncio.Event()

    async def client(number: int, conn: psycopg.AsyncConnection[object]) -> None:
        seq = 0
        while not done.is_set():
            seq += 1
            phase = sweeping if sweep.on.is_set() else alone
            started = time.perf_counter()
            async with store.once(conn, LIVE_SCOPE, f"{run}-{number}-{seq}", FP, commit=True) as op:
                op.respond(Response(201, (), BODY))
            phase.latencies.append((time.perf_counter() - started) * 1000)

    async with AsyncConnectionPool(ctx.dsn, min_size=CLIENTS, max_size=CLIENTS) as pool:
        conns = [await pool.getconn() for _ in range(CLIENTS)]
        tasks = [asyncio.create_task(client(i, c)) for i, c in enumerate(conns)]
        await asyncio.sleep(0.5)  # warm-up: prepared statements, caches
        alone.latencies.clear()
        deadline = time.perf_counter() + (ctx.seconds(LIMIT_S) if ctx.quick else LIMIT_S)
        while not sweep.drained.is_set() and time.perf_counter() < deadline:
            for phase, seconds in ((alone, ALONE_S), (sweeping, SWEEP_S)):
                if phase is sweeping:
                    sweep.on.set()
                started = time.perf_counter()
                # Ends early when the sweep drains, so that no phase counts time without a sweep.
                await asyncio.to_thread(sweep.drained.wait, seconds)
                sweep.on.clear()
                phase.seconds += time.perf_counter() - started
        done.set()
        await asyncio.gather(*tasks)
        for conn in conns:
            await pool.putconn(conn)
    return alone, sweeping


def run(ctx: BenchContext) -> list[Table]:
    rows = QUICK_ROWS if ctx.quick else ROWS
    fill_seconds = _fill(ctx, rows)
    sweep = Sweep(ctx)
    sweep.start()
    try:
        alone, sweeping = asyncio.run(_measure(ctx, sweep))
    finally:
        sweep.quit.set()
        sweep.join()
    claims = Table(
        f"Sweeper: claim latency while {sweep.deleted:,} expired keys are swept",
        [f"claims ({CLIENTS} conns)", "claims/s", "p50 ms", "p99 ms", "ratio"],
        notes=[
            f"One run of {alone.seconds + sweeping.seconds:.0f} s: {ALONE_S:.0f} s without the "
            f"sweeper, then {SWEEP_S:.0f} s with it, alternating until the {rows:,} expired keys "
            "were gone"
            + ("." if sweep.drained.is_set() else f" (stopped after {LIMIT_S:.0f} s).")
            + " A claim counts for the phase it started in.",
        ],
    )
    for name, phase, ref in (("alone", alone, None), ("**while sweeping**", sweeping, alone)):
        p99 = percentile(phase.latencies, 99)
        claims.add(
            name,
            f"{phase.tps:,.0f}",
            f"{percentile(phase.latencies, 50):.2f}",
            f"{p99:.2f}",
            ratio(p99, percentile(ref.latencies, 99), "p99 alone") if ref else "reference",
        )
    rate = sweep.deleted / sweep.seconds if sweep.seconds else 0.0
    fill_rate = rows / fill_seconds if fill_seconds else 0.0
    table = Table(
        "Sweeper: rate",
        ["what", "rows", "seconds", "rows/s", "ratio"],
        notes=[
            f"Sweep: {sweep.batches:,} batches of {DEFAULT_BATCH_SIZE:,} rows, each its own "
            f"transaction, {format_duration(DEFAULT_PAUSE)} pause between batches (the defaults), "
            "beside the claim load; seconds are those spent in sweep runs. Reference: one "
            "INSERT ... SELECT generate_series writing the same rows, before the run.",
        ],
    )
    table.add(
        "INSERT ... SELECT (reference)",
        f"{rows:,}",
        f"{fill_seconds:.1f}",
        f"{fill_rate:,.0f}",
        "reference",
    )
    table.add(
        "**pgonce sweep**",
        f"{sweep.deleted:,}",
        f"{sweep.seconds:.1f}",
        f"{rate:,.0f}",
        ratio(rate, fill_rate, "INSERT rate"),
    )
    paths = _paths(ctx, PATH_QUICK_ROWS if ctx.quick else PATH_ROWS)
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pgonce.keys WHERE scope LIKE 'sweep-bench-%'")
    return [claims, table, paths]


def _paths(ctx: BenchContext, rows: int) -> Table:
    """The two join paths of a batch, unpaused and without load: what ctid saves per row."""
    table = Table(
        "Sweeper: batch join paths (no pause, no claim load)",
        ["path", "rows", "rows/s", "ratio"],
        notes=[
            "ctid: the default on plain PostgreSQL. Primary key: the portable path, used where "
            "Citus is installed. Same statement otherwise, same rows, one after the other.",
        ],
    )
    rates = []
    for by_ctid in (True, False):
        _fill(ctx, rows)
        sweeper = Sweeper(
            schema=ctx.schema,
            ctid=by_ctid,
            limits=SweepLimits(max_batches=1_000_000, pause=timedelta(0)),
        )
        with psycopg.connect(ctx.dsn, autocommit=True) as conn:
            result = sweeper.sweep(conn)
        rates.append(result.deleted / result.seconds if result.seconds else 0.0)
        table.add(
            "ctid" if by_ctid else "**primary key (portable)**",
            f"{result.deleted:,}",
            f"{rates[-1]:,.0f}",
            "reference" if by_ctid else ratio(rates[-1], rates[0], "ctid"),
        )
    return table
