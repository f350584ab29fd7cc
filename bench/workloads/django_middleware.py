"""Django: the payments app under gunicorn, with pgonce's Idempotency-Key middleware and without.

The same Django app (``bench.django_app``: POST /payments inserts one row with the ORM and answers
201 with JSON) under one gunicorn (gthread workers, persistent connections), loaded by the
HTTP/1.1 client of the ASGI middleware's workload at the same concurrency, each request with a new
key:

- ``Django alone``: the reference; the view's INSERT commits on its own (autocommit);
- ``Django + pgonce``: ``pgonce.contrib.django``'s middleware; the claim, the row and the stored
  response commit in one transaction on Django's connection.

Rounds are interleaved (each variant first in every other round); each variant's best round is
reported, and the target is also judged on the median over the rounds of the ratio within a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from bench.context import BenchContext
from bench.django_app import SCOPE, TABLE
from bench.report import Table, Targets, percentile, ratio
from bench.servers import ROOT, cpu_seconds
from bench.workloads.http_middleware import Result, load, probe

TITLE = "Django: Idempotency-Key middleware under a WSGI server"

VARIANTS = ("none", "pgonce")
LABELS = {"none": "Django alone", "pgonce": "Django + pgonce"}
CONCURRENCY = 8
WORKERS = 2
THREADS = 4


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        return []


@contextlib.contextmanager
def gunicorn(variant: str, dsn: str, log: Path) -> Iterator[tuple[int, list[int]]]:
    """gunicorn serving ``bench.django_app`` on a socket bound here; yields (port, pids)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        f"fd://{sock.fileno()}",
        "--worker-class",
        "gthread",
        "--workers",
        str(WORKERS),
        "--threads",
        str(THREADS),
        "--no-control-socket",
        "bench.django_app:create_app()",
    ]
    env = {**os.environ, "BENCH_DJANGO_VARIANT": variant, "BENCH_HTTP_DSN": dsn}
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, pass_fds=[sock.fileno()], stdout=out, stderr=out
        )
    sock.close()
    try:
        deadline = time.monotonic() + 30
        while len(_children(process.pid)) < WORKERS or not _accepts(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn for {variant} did not start; see {log}")
            time.sleep(0.05)
        yield port, [process.pid, *_children(process.pid)]
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def _database_pids(dsn: str) -> list[int]:
    """This database's backends and PostgreSQL's background processes (not other databases'
    clients: the server may be shared)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (datname = current_database() OR backend_type <> 'client backend')"
        )
        return [int(pid) for (pid,) in rows.fetchall()]


def _cpu_each(pids: list[int]) -> dict[int, float]:
    return {pid: cpu_seconds([pid]) for pid in pids}


def _cpu_spent(before: dict[int, float]) -> float:
    """CPU seconds spent since ``before`` by the processes still alive (one that exited
    meanwhile, such as the previous server's backend, would count negative)."""
    spent = 0.0
    for pid, seconds in before.items():
        if os.path.exists(f"/proc/{pid}"):
            spent += cpu_seconds([pid]) - seconds
    return spent


def prepare(ctx: BenchContext) -> None:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY,"
            " principal text NOT NULL, amount bigint NOT NULL, currency text NOT NULL)".encode()
        )
        conn.execute(f"TRUNCATE {TABLE}".encode())


def cleanup(ctx: BenchContext) -> None:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(f"DELETE FROM {ctx.schema}.keys WHERE scope = %s".encode(), (SCOPE,))
        conn.execute(f"TRUNCATE {TABLE}".encode())


def run(ctx: BenchContext) -> list[Table]:
    prepare(ctx)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-django.log"
    log.write_text("")
    rounds = 1 if ctx.quick else 5
    seconds = ctx.seconds(5)
    runs: list[dict[str, Result]] = []
    probes: dict[str, str] = {}
    for number in range(rounds):
        runs.append({})
        for variant in VARIANTS if number % 2 == 0 else VARIANTS[::-1]:
            with gunicorn(variant, ctx.dsn, log) as (port, pids):
                asyncio.run(load(port, min(1.0, seconds), CONCURRENCY))  # warm-up
                database = _database_pids(ctx.dsn)
                server_before, database_before = cpu_seconds(pids), _cpu_each(database)
                result = asyncio.run(load(port, seconds, CONCURRENCY))
                result.server_cpu = cpu_seconds(pids) - server_before
                result.database_cpu = _cpu_spent(database_before)
                runs[-1][variant] = result
                if variant not in probes:
                    probes[variant] = asyncio.run(probe(port))
    cleanup(ctx)
    best = {v: max((r[v] for r in runs), key=lambda result: result.rps) for v in VARIANTS}
    ratios = [r["pgonce"].rps / r["none"].rps for r in runs if r["none"].rps > 0]
    reference = best["none"]
    table = Table(
        TITLE,
        [
            "variant",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "throughput",
            "server CPU µs/req",
            "PostgreSQL CPU µs/req",
            "answers",
            "retry",
        ],
    )
    for variant in VARIANTS:
        result = best[variant]
        table.add(
            LABELS[variant],
            f"{result.rps:,.0f}",
            f"{percentile(result.latencies, 50) * 1000:.1f}",
            f"{percentile(result.latencies, 99) * 1000:.1f}",
            ratio(result.rps, reference.rps, "Django alone"),
            result.per_request_us(result.server_cpu),
            result.per_request_us(result.database_cpu),
            ", ".join(f"{n}x{s}" for s, n in sorted(result.statuses.items())),
            probes.get(variant, "?"),
        )
    table.notes.append(
        f"gunicorn, {WORKERS} gthread workers x {THREADS} threads, persistent connections "
        f"(CONN_MAX_AGE=None); {CONCURRENCY} keep-alive client connections, a new key on every "
        f"request; {rounds} interleaved round(s) of {seconds:g} s, each variant's best round. "
        "Server CPU is gunicorn's master and workers; PostgreSQL CPU its backends and "
        "background processes, both per request over the measured round."
    )
    table.notes.append(
        "Django + pgonce does more per request than Django alone: BEGIN, the claim, the row, "
        "the stored response and COMMIT in one transaction, against an autocommit INSERT."
    )
    targets = Targets(
        "Django middleware: the issue's target",
        "Django + pgonce against the same app without it, from the table above.",
    )
    targets.table.notes.append(
        "Round by round: " + ", ".join(f"{100 * r:.0f}" for r in ratios) + " %."
    )
    targets.at_least(
        "Django + pgonce vs Django alone, best rounds", best["pgonce"].rps / reference.rps, 0.85
    )
    if ratios:
        targets.at_least(
            "Django + pgonce vs Django alone, median round", statistics.median(ratios), 0.85
        )
    return [table, targets.table]
