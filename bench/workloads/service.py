"""pgonce serve: ingest throughput and memory of the full service process under sustained load.

The whole service runs as it ships (``python -m pgonce serve --config ...`` in its own process):
the webhook inbox, two inbox workers handling what arrives (a no-op handler), the sweeper, the
metrics and the admin page, with JSON logs. It is loaded with new, signed deliveries for a fixed
time, while its resident memory (``VmRSS`` in ``/proc/<pid>/status``) is sampled; the peak is
reported against a target of 150 MB.

The reference is the inbox's own ingest benchmark (:mod:`bench.workloads.inbox`): the bare
receiver under uvicorn, measured in the same run with the same load function, the same signed
requests and the same concurrency. Two clients load the service: that raw keep-alive client (the
comparison), and a bounded-concurrency httpx client (what an application's own client costs;
on a small machine it is the client, not the service, that runs out of CPU first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from bench.context import BenchContext
from bench.report import Table, percentile, ratio
from bench.servers import ROOT, serve
from bench.workloads.inbox import CONCURRENCY, SECRET, load, scratch_database
from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.schemes import build_scheme

TITLE = "pgonce serve"
#: Seconds of each measured load (the short profile: 8, a quick run: 3).
LOAD_SECONDS = 20.0
SHORT_SECONDS = 8.0
QUICK_SECONDS = 3.0
#: Seconds of warm-up load before each measurement: connections, prepared statements, imports.
WARM_SECONDS = 1.0
RSS_TARGET_MB = 150.0
#: How often the service's resident memory is sampled during the load.
RSS_EVERY = 0.1
#: The inbox benchmark's signing, so that both servers receive the very same requests.
OPTIONS = {"header": "x-signature", "id_header": "x-event-id"}
#: Its own source name: the service's workers must not pick up the reference run's events.
PATH = "/webhooks/service"
CONFIG = """
[server]
log_format = "json"
[inbox]
workers = 2
[admin]
token = "env:BENCH_SERVICE_ADMIN_TOKEN"
[sources.service]
scheme = "generic-hmac"
secrets = ["env:BENCH_SERVICE_SECRET"]
options = { header = "x-signature", id_header = "x-event-id" }
handler = "bench.workloads.service:noop"
"""


async def noop(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    """The handler the service runs: nothing, so that the figures are pgonce's own cost."""


@dataclass(frozen=True)
class Running:
    pid: int
    port: int


@contextlib.contextmanager
def service(dsn: str, schema: str, log: Path) -> Iterator[Running]:
    """``pgonce serve`` with :data:`CONFIG` on a port it picks; stopped with SIGTERM on exit."""
    folder = Path(tempfile.mkdtemp(prefix="pgonce-bench-service-"))
    config = folder / "pgonce.toml"
    config.write_text(CONFIG)
    env = {
        **os.environ,
        "BENCH_SERVICE_SECRET": SECRET,
        "BENCH_SERVICE_ADMIN_TOKEN": uuid.uuid4().hex,
    }
    with log.open("ab") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "pgonce", "serve", "--config", str(config), "--dsn", dsn,
             "--schema", schema, "--port", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )  # fmt: skip
    try:
        assert process.stdout is not None
        port = 0
        for line in process.stdout:
            if "serving on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        if not port:
            raise RuntimeError(f"pgonce serve did not start; see {log}")
        yield Running(process.pid, port)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise RuntimeError(f"pgonce serve did not stop on SIGTERM; see {log}") from None
        if code != 0:
            raise RuntimeError(f"pgonce serve exited with {code}; see {log}")


def rss_mb(pid: int) -> float:
    """The resident memory of ``pid`` in MB (VmRSS), 0 if it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def httpx_load(port: int, seconds: float) -> tuple[float, float, dict[int, int]]:
    """Requests/s, p99 in ms and status counts of ``CONCURRENCY`` httpx senders on one client."""
    scheme = build_scheme("generic-hmac", [SECRET], options=OPTIONS)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    stop_at = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30
    ) as client:

        async def sender() -> None:
            while time.perf_counter() < stop_at:
                event_id = f"evt_{uuid.uuid4().hex}"
                body = json.dumps({"id": event_id, "type": "invoice.paid", "amount": 4200})
                headers = scheme.sign(body.encode(), event_id=event_id)
                headers["content-type"] = "application/json"
                started = time.perf_counter()
                response = await client.post(PATH, content=body, headers=headers)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, percentile(latencies, 99) * 1000, statuses


@dataclass(frozen=True)
class Measured:
    rps: float
    p99_ms: float
    statuses: dict[int, int]
    peak_rss_mb: float
    #: CPU the load generator (this process) spent per request.
    client_cpu_us: float


async def under_load(pid: int, port: int, seconds: float, client: str) -> Measured:
    """Load the service with ``client`` ("raw" or "httpx") while sampling its memory."""
    peak = rss_mb(pid)
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb(pid))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), RSS_EVERY)

    sampler = asyncio.create_task(sample())
    cpu = time.process_time()
    try:
        if client == "raw":
            rps, p99, statuses = await load(port, PATH, seconds)
        else:
            rps, p99, statuses = await httpx_load(port, seconds)
    finally:
        done.set()
        await sampler
    cpu = time.process_time() - cpu
    requests = sum(statuses.values())
    return Measured(
        rps, p99, statuses, max(peak, rss_mb(pid)), cpu / requests * 1e6 if requests else 0.0
    )


def backlog(dsn: str, schema: str) -> tuple[int, int]:
    """(stored, still pending) events of the service's source."""
    query = sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE status = 'pending') FROM {}.inbox "
        "WHERE source = 'service'"
    ).format(sql.Identifier(schema))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def run(ctx: BenchContext) -> list[Table]:
    seconds = ctx.pick(LOAD_SECONDS, short=SHORT_SECONDS, quick=QUICK_SECONDS)
    warm = min(WARM_SECONDS, seconds)
    logs = Path(tempfile.gettempdir())
    with scratch_database(ctx.dsn, ctx.schema) as dsn:
        with serve(
            "bench.workloads.inbox:create_app",
            {"BENCH_INBOX_DSN": dsn},
            logs / "pgonce-bench-service-inbox.log",
        ) as port:
            asyncio.run(load(port, "/webhooks/bench", warm))
            cpu = time.process_time()
            inbox = asyncio.run(load(port, "/webhooks/bench", seconds))
            inbox_cpu = (time.process_time() - cpu) / max(1, sum(inbox[2].values())) * 1e6
        with service(dsn, ctx.schema, logs / "pgonce-bench-service.log") as running:
            idle = rss_mb(running.pid)
            asyncio.run(load(running.port, PATH, warm))
            raw = asyncio.run(under_load(running.pid, running.port, seconds, "raw"))
            stored, pending = backlog(dsn, ctx.schema)
            with_httpx = asyncio.run(under_load(running.pid, running.port, seconds, "httpx"))

    table = Table(
        "pgonce serve: ingest under sustained load, and the service's memory",
        [
            "server",
            "client",
            "requests/s",
            "p99 ms",
            "statuses",
            "client CPU µs/req",
            "peak RSS",
            "vs inbox alone",
        ],
    )
    table.add(
        "inbox receiver alone (uvicorn)",
        "raw keep-alive",
        f"{inbox[0]:,.0f}",
        f"{inbox[1]:.1f}",
        inbox[2],
        f"{inbox_cpu:,.0f}",
        "",
        ratio(inbox[0], inbox[0], "inbox"),
    )
    for client, m in (("raw keep-alive", raw), ("httpx", with_httpx)):
        table.add(
            "pgonce serve (full service)",
            client,
            f"{m.rps:,.0f}",
            f"{m.p99_ms:.1f}",
            m.statuses,
            f"{m.client_cpu_us:,.0f}",
            f"{m.peak_rss_mb:.0f} MB",
            ratio(m.rps, inbox[0], "inbox"),
        )
    peak = max(raw.peak_rss_mb, with_httpx.peak_rss_mb)
    verdict = "within" if peak <= RSS_TARGET_MB else "OVER"
    table.notes.append(
        f"{CONCURRENCY} concurrent keep-alive connections send new, HMAC-signed events for "
        f"{seconds:g} s per row (after {warm:g} s of warm-up), to a scratch database. The full "
        "service is `python -m pgonce serve` in its own process: the inbox with two workers "
        "running a no-op handler as events arrive, the sweeper, /metrics, the admin page and "
        "JSON logs on. The reference row is the inbox benchmark's own server and load function "
        "(bench/workloads/inbox.py), measured in the same run with the same requests."
    )
    table.notes.append(
        f"Service RSS: {idle:.0f} MB idle after start, peak {peak:.0f} MB under load "
        f"(sampled every {RSS_EVERY:g} s from /proc/<pid>/status VmRSS): {verdict} the "
        f"{RSS_TARGET_MB:.0f} MB target. At the end of the raw load the service had stored "
        f"{stored:,} events (warm-up included), {pending:,} of them still pending for its "
        "workers. The httpx row is one httpx.AsyncClient (a pool of "
        f"{CONCURRENCY} connections) in the bench process: compare its client CPU per request "
        "with the raw client's to see whether that row measures the service or the client."
    )
    return [table]
