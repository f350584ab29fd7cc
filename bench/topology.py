"""Production topology figures: PgBouncer in transaction mode, LISTEN, pools that fail fast.

``python -m bench.topology [--quick]`` starts a PgBouncer 1.18 of its own (transaction mode, the
suite's launcher) in front of ``PGONCE_BENCH_DSN`` (default: the machine's server) and measures:

- claims for 10 s on 8 connections through it, with every setting at its default (psycopg's
  ``prepare_threshold`` too), then with ``prepare_threshold=None``: how many won, how many
  failed and with what error, and how many connections the key store refused;
- an inbox worker's wake-up (delivery stored -> handler ran) and the outbox relay's (row
  committed -> published), median of 20, with LISTEN on a direct connection (``listen_dsn``) and
  through the pooler (polling);
- how long a request waits for an exhausted pool before it is told 503: the service's pool;
- after a 10 s outage (a proxy refusing connections), how long after the server is back the first
  request gets a connection: psycopg_pool's defaults against the service's pool.

The claim run alone is also a script (``python -m bench.topology claims DSN``) that uses only the
key store's public API, so that the same run can be made against an older pgonce
(``PYTHONPATH=<its src>``) for a before-and-after figure. Results go to
``bench/results/topology.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from bench.report import Table
from pgonce import AsyncKeyStore, Response, UsageError, Won, fingerprint
from pgonce.store import wire
from tools.provenance import header

RESULTS = Path(__file__).parent / "results" / "topology.md"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


async def claims(
    dsn: str, seconds: float, connections: int, **connect_kwargs: Any
) -> dict[str, Any]:
    """Fresh keys claimed and completed on ``connections`` for ``seconds``; what came of them.

    A connection the key store refuses (one that lets psycopg prepare statements once pgonce
    found the server's sessions shared) stops there: it is counted once, as ``refused``.
    """
    store = AsyncKeyStore()
    outcome: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    run = uuid.uuid4().hex[:8]

    async def client(number: int) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, **connect_kwargs) as conn:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                try:
                    claim = await store.begin(conn, "bench", f"{run}-{number}-{n}", FP)
                    assert isinstance(claim, Won)
                    await store.commit(conn, claim, Response(201))
                except UsageError:
                    outcome["refused"] += 1
                    return
                except Exception as error:
                    outcome["failed"] += 1
                    cause = error.__cause__ or error
                    errors[getattr(cause, "sqlstate", None) or type(cause).__name__] += 1
                    if conn.closed:
                        return
                else:
                    outcome["won"] += 1

    await asyncio.gather(*(client(i) for i in range(connections)))
    return {
        "won": outcome["won"],
        "failed": outcome["failed"],
        "refused": outcome["refused"],
        "errors": dict(errors),
    }


FP = fingerprint("bench-topology")


async def wake_ups(pooled: str, direct: str, listen: str, count: int) -> list[float]:
    """Seconds from a stored delivery to its handler, for a worker listening on ``listen``."""
    from pgonce.core.inbox import Delivery, digest
    from pgonce.store._async.inbox import AsyncInboxStore
    from pgonce.webhooks.worker import InboxWorker
    from tests.inbox.conftest import source as test_source

    handled: dict[str, float] = {}
    arrived: dict[str, asyncio.Event] = {}

    async def handler(event: Any, conn: Any) -> None:
        handled[event.id] = time.perf_counter()
        arrived[event.id].set()

    name = f"bench{uuid.uuid4().hex[:6]}"
    worker = InboxWorker(
        [test_source(name, handler=handler)],
        dsn=pooled,
        listen_dsn=listen,
        connect_kwargs={"prepare_threshold": None},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    store = AsyncInboxStore()
    latencies = []
    try:
        await asyncio.sleep(1.5)  # the loops' first look finds nothing; they wait
        async with await psycopg.AsyncConnection.connect(direct) as conn:
            for i in range(count):
                event_id = f"e{i}"
                arrived[event_id] = asyncio.Event()
                body = b"{}"
                async with conn.transaction():
                    stored = time.perf_counter()
                    await store.store(conn, [Delivery(name, event_id, body, {}, digest(body))])
                await asyncio.wait_for(arrived[event_id].wait(), 30)
                latencies.append(handled[event_id] - stored)
                await asyncio.sleep(0.3)  # idle again, as between real deliveries
    finally:
        stop.set()
        await task
    return latencies


class _Clock:
    """A publisher that acknowledges everything and notes when each row reached it."""

    name = "clock"

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.arrived = asyncio.Event()

    async def publish(self, batch: Any) -> Any:
        from pgonce.publishers.base import PublishResult

        now = time.perf_counter()
        for message in batch:
            self.seen[message.id] = now
        self.arrived.set()
        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        return None


async def relay_wake_ups(pooled: str, direct: str, listen: str, count: int) -> list[float]:
    """Seconds from a committed outbox row to its publication, for a relay listening on
    ``listen``; its other connections go through ``pooled``."""
    from pgonce.relay import Relay
    from pgonce.store._async.outbox import AsyncOutboxStore

    clock = _Clock()
    relay = Relay(pooled, clock, listen_dsn=listen, prepare_threshold=None)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    store = AsyncOutboxStore()
    latencies = []
    try:
        await asyncio.sleep(1.5)  # the relay's first look finds nothing; it waits
        async with await psycopg.AsyncConnection.connect(direct) as conn:
            for i in range(count):
                clock.arrived.clear()
                async with conn.transaction():
                    row = await store.enqueue(conn, "bench", str(i), "bench.event", {})
                committed = time.perf_counter()
                while row not in clock.seen:
                    await asyncio.wait_for(clock.arrived.wait(), 30)
                    clock.arrived.clear()
                latencies.append(clock.seen[row] - committed)
                await asyncio.sleep(0.3)
    finally:
        stop.set()
        await task
    return latencies


async def time_to_503(dsn: str) -> float:
    """Seconds an exhausted service pool makes a request wait before its error (the 503)."""
    from pgonce.service.config import PoolConfig
    from pgonce.service.pools import request_pool

    async with request_pool(dsn, PoolConfig(min_size=1, max_size=1), {}) as pool:
        held = await pool.getconn()
        started = time.perf_counter()
        try:
            async with pool.connection():
                pass
        except Exception:
            return time.perf_counter() - started
        finally:
            await pool.putconn(held)
    raise AssertionError("the exhausted pool gave a connection")


async def back_after_outage(dsn: str, service_pool: bool, outage: float) -> float:
    """Seconds from the server accepting connections again to a request getting one."""
    from faults.proxy import Proxy
    from pgonce.service.config import PoolConfig
    from pgonce.service.pools import request_pool

    params = conninfo_to_dict(dsn)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    proxy = (
        Proxy(unix_path=f"{host}/.s.PGSQL.{port}")
        if host.startswith("/")
        else Proxy(tcp=(host, port))
    )
    with proxy:
        proxied = make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
        pool = (
            request_pool(proxied, PoolConfig(), {"connect_timeout": 2})
            if service_pool
            else AsyncConnectionPool(proxied, min_size=2, max_size=10, open=False)
        )
        async with pool:
            await pool.wait()
            proxy.refuse(True)
            until = time.monotonic() + outage
            while time.monotonic() < until:  # requests keep coming, as they would
                await _request(pool)
                await asyncio.sleep(0.1)
            proxy.refuse(False)
            back = time.perf_counter()
            # A client's request every 50 ms, each waiting at most a second for a connection.
            for _ in range(int(outage * 20) + 600):
                if await _request(pool):
                    return time.perf_counter() - back
                await asyncio.sleep(0.05)
            raise AssertionError("the pool never came back")


async def _request(pool: AsyncConnectionPool[Any]) -> bool:
    try:
        async with pool.connection(timeout=1) as conn:
            await conn.execute("SELECT 1")
    except Exception:
        return False
    return True


def _database(server: str) -> str:
    """A fresh migrated database on ``server`` for one measurement."""
    from psycopg import sql

    from pgonce.store.migrate import migrate

    name = f"pgonce_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(server, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, "pgonce")
    return dsn


def _drop(server: str, dsn: str) -> None:
    from psycopg import sql

    name = str(conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _through(pooled_server: str, dsn: str) -> str:
    return make_conninfo(pooled_server, dbname=conninfo_to_dict(dsn)["dbname"])


WakeUps = Callable[[str, str, str, int], Awaitable[list[float]]]


async def _wake_up_table(
    title: str, measure_one: WakeUps, pooled: str, dsn: str, count: int
) -> Table:
    """Wake-ups with LISTEN on a direct connection, then through the pooler (polling)."""
    table = Table(f"{title}, median of {count}", ["LISTEN on", "median ms", "max ms"])
    for label, listen in (("listen_dsn (direct)", dsn), ("the pooler (polling)", pooled)):
        found = await measure_one(pooled, dsn, listen, count)
        table.add(label, f"{statistics.median(found) * 1000:.0f}", f"{max(found) * 1000:.0f}")
    return table


async def measure(server: str, quick: bool) -> list[Table]:
    from tests.pgbouncer import running_pgbouncer

    seconds, count, outage = (2.0, 5, 4.0) if quick else (10.0, 20, 10.0)
    tables = []
    with running_pgbouncer(server) as pooled_server:
        dsn = _database(server)
        try:
            pooled = _through(pooled_server, dsn)
            claim_table = Table(
                f"Claims through PgBouncer 1.18 (transaction mode), {seconds:.0f} s, 8 connections",
                ["psycopg's prepare_threshold", "won", "failed", "connections refused", "errors"],
            )
            for label, kwargs in (("default (5)", {}), ("None", {"prepare_threshold": None})):
                wire._reset_naming()  # each run finds the pooler anew, as a new process would
                found = await claims(pooled, seconds, 8, **kwargs)
                errors = found["errors"] or "none"
                claim_table.add(label, found["won"], found["failed"], found["refused"], errors)
            tables.append(claim_table)

            for title, measure_one in (
                ("Inbox wake-up through PgBouncer (stored -> handler ran)", wake_ups),
                ("Outbox relay wake-up through PgBouncer (committed -> published)", relay_wake_ups),
            ):
                tables.append(await _wake_up_table(title, measure_one, pooled, dsn, count))
        finally:
            _drop(server, dsn)
    fail = Table("Pools that fail fast and come back", ["figure", "psycopg_pool defaults",
                                                        "service pool"])  # fmt: skip
    fail.add("request wait for an exhausted pool (then 503)", "30 s (its timeout)",
             f"{await time_to_503(server):.2f} s")  # fmt: skip
    default_back = await back_after_outage(server, False, outage)
    service_back = await back_after_outage(server, True, outage)
    fail.add(f"first connection after a {outage:.0f} s outage, from the server's return",
             f"{default_back:.2f} s", f"{service_back:.2f} s")  # fmt: skip
    tables.append(fail)
    return tables


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.topology", description=__doc__)
    parser.add_argument("what", nargs="?", default="all", choices=["all", "claims"])
    parser.add_argument("dsn", nargs="?", default=os.environ.get("PGONCE_BENCH_DSN", DEFAULT_DSN))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.what == "claims":
        print(json.dumps(asyncio.run(claims(args.dsn, args.seconds, 8))))
        return 0
    tables = asyncio.run(measure(args.dsn, args.quick))
    with psycopg.connect(args.dsn) as conn:
        row = conn.execute("SELECT version()").fetchone()
    command = "python -m bench.topology" + (" --quick" if args.quick else "")
    lines = header("Production topology", command=command, postgres=str(row[0] if row else "?"),
                   profile="quick" if args.quick else "full")  # fmt: skip
    text = "\n".join(lines) + "\n" + "\n".join(t.markdown() for t in tables)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
