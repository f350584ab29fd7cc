"""PostgreSQL taken away under load, and pgonce left to recover by itself.

The service (inbox, workers, relay) and the payments app run under the same continuous load as in
the kill scenario; none of them is restarted by the suite. Three faults:

- the suite's own PostgreSQL restarted, alternately in fast and immediate shutdown mode (immediate
  is a crash as far as the data is concerned: WAL replay on start);
- every connection cut by the suite's TCP proxy between pgonce and PostgreSQL, at random moments,
  mid-transaction;
- statement timeouts: ``statement_timeout`` set to a few milliseconds for the database and the
  connections cut so that every new session gets it, for a few seconds at a time.

Checks: the processes answer /readyz (or /health) again on their own, each was started once and is
still running, and the accounting holds (nothing acknowledged lost, nothing doubled, no 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx
import psycopg

from faults.context import Context
from faults.load import MIXED_LOAD
from faults.proxy import Proxy
from faults.report import Result

#: How long the processes may take to answer again after a fault before "recovered" fails.
RECOVERY_TIMEOUT = 60.0

Fault = Callable[[int], Awaitable[str]]


async def _ready(urls: list[str], within: float = RECOVERY_TIMEOUT) -> float | None:
    """Seconds until every URL answers 200, or None after ``timeout``."""
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        break
                if time.monotonic() - began > within:
                    return None
                await asyncio.sleep(0.05)
    return time.monotonic() - began


async def _under_load(
    ctx: Context,
    result: Result,
    *,
    database: str,
    service_dsn: Callable[[str], str],
    faults: int,
    fault: Fault,
) -> Result:
    """Run the service and the payments app on ``service_dsn(database)`` under load, inject
    ``fault(i)`` ``faults`` times at random moments, and account for everything."""
    direct = ctx.database(database)
    dsn = service_dsn(database)
    with ctx.processes() as procs:
        served = ctx.serve(procs, database, dsn, amounts=3_000_000, minimum=ctx.size(20, 3))
        service, load = served.service, served.load
        load.start()
        urls = [
            f"http://127.0.0.1:{served.port}/readyz",
            f"http://127.0.0.1:{served.pay_port}/health",
        ]
        recoveries: list[float | None] = []
        done: list[str] = []
        for i in range(faults):
            await asyncio.sleep(ctx.rng.uniform(0.3, 1.5))
            with load.faults.window(f"fault {i}"):
                done.append(await fault(i))
                recoveries.append(await _ready(urls))
        await asyncio.sleep(1.0)  # load after the last fault, on the recovered processes
        result.acc = await load.finish(direct, ctx.redis_url, within=ctx.size(60, 20))
        untouched = served.untouched()
    ctx.bodies.extend(load.bodies)
    ended = [
        line.split('"message": ', 1)[-1][:300]
        for line in service.log.read_text(errors="replace").splitlines()
        if "ended with an error" in line
    ]
    result.check(
        "every loop of the service was still running when it was stopped"
        + (": " + "; ".join(ended) if ended else ""),
        not ended,
    )
    finished = [r for r in recoveries if r is not None]
    result.faults = f"{faults} × {result.faults}"
    result.check(
        f"the service and the app answered again by themselves after every fault "
        f"(slowest: {max(finished, default=0):.1f} s)",
        len(finished) == faults,
    )
    result.check("no process was restarted: each was started once and still runs", untouched)
    result.checks += load.checks()
    result.acc.notes.append("faults: " + "; ".join(sorted(set(done))))
    return result


async def postgres_restarts(ctx: Context) -> Result:
    count = ctx.size(12, 2)
    result = Result(
        "PostgreSQL restarted under load (fast, immediate)",
        MIXED_LOAD,
        "PostgreSQL restart, alternately `pg_ctl stop -m fast` and `-m immediate`, down 0.2-1.5 s",
    )

    async def fault(i: int) -> str:
        mode = ("fast", "immediate")[i % 2]
        down = ctx.rng.uniform(0.2, 1.5)
        took = await asyncio.to_thread(ctx.pg.restart, mode, down)
        return f"{mode} restarts (down up to {took:.1f} s)" if took > 3 else f"{mode} restarts"

    return await _under_load(
        ctx, result, database="restarts", service_dsn=lambda db: _socket_dsn(ctx, db),
        faults=count, fault=fault,
    )  # fmt: skip


def _socket_dsn(ctx: Context, database: str) -> str:
    return ctx.pg.dsn.replace("/postgres?", f"/{database}?")


async def connection_cuts(ctx: Context) -> Result:
    count = ctx.size(30, 3)
    result = Result(
        "connections cut mid-transaction (TCP proxy)",
        MIXED_LOAD,
        "every open connection between pgonce and PostgreSQL reset by the suite's proxy",
    )
    with Proxy(unix_path=ctx.pg.socket) as proxy:

        async def fault(i: int) -> str:
            cut = proxy.cut()
            return f"cuts of {cut} connections" if cut < 5 else "cuts of 5+ connections"

        await _under_load(
            ctx, result, database="cuts", service_dsn=lambda db: ctx.pg.tcp_dsn(proxy.port, db),
            faults=count, fault=fault,
        )  # fmt: skip
        result.acc.notes.append(
            f"proxy: {proxy.accepted} connections accepted, {proxy.cut_connections} cut"
        )
    return result


async def statement_timeouts(ctx: Context) -> Result:
    count = ctx.size(6, 1)
    result = Result(
        "statement timeouts",
        MIXED_LOAD,
        "`statement_timeout = 2ms` for 3 s (database setting, connections cut so that every "
        "session gets it), then reset",
    )
    with Proxy(unix_path=ctx.pg.socket) as proxy:
        direct = _socket_dsn(ctx, "timeouts")

        def set_timeout(value: str | None) -> None:
            # Its own statement_timeout off: the database's 2 ms must not cancel the reset
            # itself (a client's startup options win over a database's settings).
            with psycopg.connect(direct, autocommit=True, options="-c statement_timeout=0") as conn:
                if value is None:
                    conn.execute("ALTER DATABASE timeouts RESET statement_timeout")
                else:
                    conn.execute(f"ALTER DATABASE timeouts SET statement_timeout = '{value}'")

        async def fault(i: int) -> str:
            await asyncio.to_thread(set_timeout, "2ms")
            proxy.cut()
            await asyncio.sleep(3)
            await asyncio.to_thread(set_timeout, None)
            proxy.cut()
            return "2 ms statement timeouts for 3 s"

        await _under_load(
            ctx, result, database="timeouts",
            service_dsn=lambda db: ctx.pg.tcp_dsn(proxy.port, db), faults=count, fault=fault,
        )  # fmt: skip
    return result
