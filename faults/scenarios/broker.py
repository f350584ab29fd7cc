"""The broker taken away mid-relay and given back: every committed outbox row is delivered.

Two relay processes (``pgonce relay``) publish to the suite's own redis-server through the suite's
TCP proxy while an application enqueues rows continuously. Faults: the proxy cuts every connection
and refuses new ones for 0.5-3 s (the broker is unreachable), and the redis-server itself is
stopped (SIGTERM; it keeps what it acknowledged in its fsynced AOF) and started again. Only the
suite's own proxy and redis-server are touched, never the machine's brokers.
"""

from __future__ import annotations

import asyncio
import time

from faults.context import Context
from faults.load import FaultLog, OutboxLoad
from faults.procs import wait_redis
from faults.proxy import Proxy
from faults.report import Result
from pgonce.relay import DEFAULT_CONCURRENCY


async def broker_outage(ctx: Context) -> Result:
    outages = ctx.size(16, 2)
    restarts = ctx.size(3, 1)
    dsn = ctx.database("broker")
    redis_port = int(ctx.redis_url.rsplit(":", 1)[1].split("/")[0])
    run = "broker"
    with Proxy(tcp=("127.0.0.1", redis_port)) as proxy, ctx.processes() as procs:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        relays = [procs.part(f"broker-relay-{i}", "relay", dsn, url) for i in range(2)]
        ctx.keep_logs(procs)
        outbox = OutboxLoad(dsn, run)
        stop = asyncio.Event()
        load = asyncio.create_task(outbox.run_until(stop, pause=0.002))
        # Faults start once both relays are connected and publishing (bounded wait).
        deadline = time.monotonic() + 60
        while proxy.accepted < len(relays) and time.monotonic() < deadline:  # noqa: ASYNC110
            # A counter of the proxy's thread, not an event of this loop: polled, bounded.
            await asyncio.sleep(0.05)
        plan = ["cut"] * outages + ["restart"] * restarts
        ctx.rng.shuffle(plan)
        faults = FaultLog()
        for step in plan:
            await asyncio.sleep(ctx.rng.uniform(0.3, 1.5))
            with faults.window(step):
                if step == "cut":
                    proxy.refuse(True)
                    await asyncio.sleep(ctx.rng.uniform(0.5, 3.0))
                    proxy.refuse(False)
                else:
                    await asyncio.to_thread(ctx.redis.stop)
                    await asyncio.sleep(ctx.rng.uniform(0.5, 2.0))
                    await asyncio.to_thread(ctx.redis.start)
                    await asyncio.to_thread(wait_redis, redis_port)
        await asyncio.sleep(1.0)
        stop.set()
        await load
        acc, checks = await outbox.account(
            dsn, ctx.redis_url, faults, relay_loops=len(relays) * DEFAULT_CONCURRENCY, within=120
        )
        running = all(r.alive() and r.starts == 1 for r in relays)
    result = Result(
        "broker stopped mid-relay",
        "an application enqueueing outbox rows continuously (20 aggregates); 2 `pgonce relay` "
        "processes publishing to redis through the suite's proxy",
        f"{outages} broker outages (connections cut, new ones refused for 0.5-3 s) and "
        f"{restarts} redis-server stops and starts",
        acc=acc,
    )
    minimum = ctx.size(2000, 200)
    result.check(
        f"the load proves something: at least {minimum} rows committed and published "
        f"(got {len(outbox.committed)} committed, {acc.effects} consumed)",
        min(len(outbox.committed), acc.effects) >= minimum,
    )
    result.check("every committed row reached the consumer, none lost", acc.lost == 0)
    result.checks += checks
    result.check("the relays recovered by themselves (started once, still running)", running)
    result.acc.notes.append(
        f"proxy: {proxy.accepted} connections accepted, {proxy.cut_connections} cut"
    )
    return result
