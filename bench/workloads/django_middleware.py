"""Django: the payments app under gunicorn, with pgonce's Idempotency-Key middleware and without.

The same Django app (``bench.django_app``: POST /payments inserts one row with the ORM and answers
201 with JSON) under one gunicorn (gthread workers, persistent connections), loaded by the
HTTP/1.1 client of the ASGI middleware's workload at the same concurrency, each request with a new
key:

- ``Django alone``: the reference; the view's INSERT commits on its own (autocommit);
- ``Django alone, ATOMIC_REQUESTS``: the view in a transaction (BEGIN, INSERT, COMMIT), what the
  one-transaction design costs before any key is claimed;
- ``Django + pgonce``: ``pgonce.contrib.django``'s middleware; the claim, the row and the stored
  response commit in one transaction on Django's connection.

Rounds are interleaved (each variant first in every other round); each variant's best round is
reported, and the target is also judged on the median over the rounds of the ratio within a round.
"""

from __future__ import annotations

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

from bench.context import BenchContext
from bench.django_app import SCOPE, TABLE
from bench.pairs import VARIANTS as PAIR
from bench.pairs import cleanup_payments, compare, measure, prepare_payments
from bench.report import Table
from bench.servers import ROOT
from bench.workloads.http_middleware import Result

TITLE = "Django: Idempotency-Key middleware under a WSGI server"

#: The pair every adapter's workload compares, and the app in a transaction of its own beside them.
VARIANTS = ("atomic", *PAIR)
LABELS = {
    "atomic": "Django alone, ATOMIC_REQUESTS",
    "none": "Django alone",
    "pgonce": "Django + pgonce",
}
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


def run(ctx: BenchContext) -> list[Table]:
    prepare_payments(ctx.dsn, TABLE)
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
                runs[-1][variant], probes[variant] = measure(
                    port, pids, ctx.dsn, seconds, CONCURRENCY
                )
    cleanup_payments(ctx.dsn, ctx.schema, SCOPE, TABLE)
    atomic = [r["pgonce"].rps / r["atomic"].rps for r in runs if r["atomic"].rps > 0]
    notes = [
        f"gunicorn, {WORKERS} gthread workers x {THREADS} threads, persistent connections "
        f"(CONN_MAX_AGE=None); {CONCURRENCY} keep-alive client connections, a new key on every "
        f"request; {rounds} interleaved round(s) of {seconds:g} s, each variant's best round. "
        "Server CPU is gunicorn's master and workers; PostgreSQL CPU its backends and "
        "background processes, both per request over the measured round.",
        "Django + pgonce does more per request than Django alone: BEGIN, the claim, the row, "
        "the stored response and COMMIT in one transaction, against an autocommit INSERT. "
        "Against the app alone with ATOMIC_REQUESTS (the same transaction, no key), median "
        f"round: {100 * statistics.median(atomic):.0f} %.",
    ]
    return compare(TITLE, LABELS, runs, probes, notes)
