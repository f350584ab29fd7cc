"""pgonce behind PgBouncer in transaction pooling mode, under load.

The suite starts a PgBouncer of its own (:mod:`faults.cluster`) in transaction mode in front of its
PostgreSQL; the service (webhook receiver, inbox workers, relay), the payments app and the
application enqueueing outbox rows all connect through it, so that consecutive transactions of one
client run on different server connections, and one server connection serves many clients.

What must hold: nothing acknowledged lost, nothing doubled, no 500, and no prepared statement of
one client met by another (PostgreSQL's 42P05 "already exists" and 26000 "does not exist", or a
bind message with another statement's parameter count) in any process's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator

from faults.cluster import pgbouncer
from faults.context import Context
from faults.load import MIXED_LOAD, MixedLoad
from faults.report import Result
from pgonce.config import TRANSACTION_POOLER

#: What a crossed or lost prepared statement looks like in a log line.
CROSSED = ("prepared statement", "42P05", "26000", "bind message supplies")


async def _acknowledged(load: MixedLoad, count: int, within: float) -> bool:
    """Wait (bounded) until the load had ``count`` events and ``count`` payments acknowledged."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if len(load.hooks.acked) >= count and len(load.pays.first) >= count:
            return True
        await asyncio.sleep(0.1)
    return False


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` in this process's environment, which the processes it starts inherit."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


async def pgbouncer_load(ctx: Context) -> Result:
    target = ctx.size(2000, 200)
    direct = ctx.database("pooler")
    with (
        pgbouncer(host=str(ctx.pg.socket_dir), port=ctx.pg.port) as pool,
        # The documented setting for PgBouncer < 1.21: no prepared statements, pgonce's own or
        # psycopg's, in the service, the app (examples/payments reads it) and the relay.
        _environment("PGONCE_POOLER", TRANSACTION_POOLER),
    ):
        dsn = pool.dsn("pooler")
        with ctx.processes() as procs:
            served = ctx.serve(procs, "pooler", dsn, amounts=4_000_000, minimum=ctx.size(300, 20))
            load = served.load
            load.start()
            reached = await _acknowledged(load, target, ctx.size(300, 90))
            result = Result(
                f"{pool.version()} in transaction pooling mode",
                MIXED_LOAD
                + "; the service, the app and the outbox's application through PgBouncer",
                f"every transaction through {pool.version()} (pool_mode = transaction, "
                "default_pool_size = 20): a client's consecutive transactions on different server "
                "connections",
            )
            result.acc = await load.finish(direct, ctx.redis_url, within=ctx.size(60, 20))
            untouched = served.untouched()
        logs = [p.log for p in (served.service, served.payments)]
    ctx.bodies.extend(load.bodies)
    crossed = [
        line.strip()[:200]
        for log in logs
        for line in log.read_text(errors="replace").splitlines()
        if any(mark in line for mark in CROSSED)
    ]
    result.check(f"the load reached {target} events and {target} payments acknowledged", reached)
    result.check(
        "no prepared statement crossed between clients or lost by the pooler in any log"
        + (f" ({len(crossed)} lines, the first: {crossed[0]})" if crossed else ""),
        not crossed,
    )
    result.check("no process was restarted: each was started once and still runs", untouched)
    result.check(
        f"no outbox transaction failed ({load.outbox.in_doubt} did): nothing was injected",
        load.outbox.in_doubt == 0,
    )
    result.checks += load.checks()
    return result
