"""kill -9 at random moments: the service, a separate inbox worker, a separate relay and the
payments app (Idempotency-Key middleware), each restarted after its kill, under continuous load.

The load is a webhook provider redelivering until acknowledged, an API client retrying with its
Idempotency-Key until it gets its 201, and an application enqueueing outbox rows. At the end every
acknowledged event was handled once, every acknowledged payment exists once and replays its 201
verbatim, every committed outbox row reached the broker, and no inbox event is left unresolved.
"""

from __future__ import annotations

import asyncio
import time

from faults.context import Context
from faults.load import MIXED_LOAD, MixedLoad
from faults.procs import Proc
from faults.proxy import free_port
from faults.report import Result

#: A process without an HTTP readiness check (worker, relay) is killed only after it has run this
#: long since its start, so that the kill lands in its loop rather than in its imports.
SETTLE_SECONDS = 1.5


async def kill_nine(ctx: Context) -> Result:
    total = ctx.size(120, 8)
    dsn = ctx.database("kills")
    port, pay_port = free_port(), free_port()
    run = "kills"
    with ctx.processes() as procs:
        targets = [
            procs.service("kill-service", dsn, port, ctx.redis_url),
            procs.part("kill-worker", "worker", dsn, ctx.redis_url),
            procs.part("kill-relay", "relay", dsn, ctx.redis_url),
            procs.payments("kill-payments", dsn, pay_port),
        ]
        ctx.keep_logs(procs)
        load = MixedLoad(
            ctx.scheme, service_port=port, payments_port=pay_port, outbox_dsn=dsn, run=run,
            amounts=2_000_000, relays=2, minimum=ctx.size(20, 3),
        )  # fmt: skip
        load.start()
        started_at = {t.name: time.monotonic() for t in targets}
        restarting: dict[str, asyncio.Task[None]] = {}

        async def restart(target: Proc, killed_at: float) -> None:
            try:
                await asyncio.to_thread(target.start)
                started_at[target.name] = time.monotonic()
            finally:
                load.faults.add(f"kill {target.name}", killed_at)
                restarting.pop(target.name, None)

        kills = 0
        deadline = time.monotonic() + ctx.size(480, 90)
        while kills < total and time.monotonic() < deadline:
            await asyncio.sleep(ctx.rng.uniform(0.05, 0.5))
            now = time.monotonic()
            ready = [
                t
                for t in targets
                if t.name not in restarting
                and (t.ready_url is not None or now - started_at[t.name] >= SETTLE_SECONDS)
            ]
            if not ready:
                continue
            target = ctx.rng.choice(ready)
            killed_at = time.time()
            target.kill()
            kills += 1
            restarting[target.name] = asyncio.create_task(restart(target, killed_at))
        await asyncio.gather(*restarting.values())
        result = Result(
            "kill -9: service, worker, relay, payments app",
            MIXED_LOAD,
            f"{kills} SIGKILLs at random moments ("
            + ", ".join(f"{t.name.removeprefix('kill-')} {t.kills}" for t in targets)
            + "), each process restarted",
        )
        result.acc = await load.finish(dsn, ctx.redis_url, within=ctx.size(90, 30))
    ctx.bodies.extend(load.bodies)
    result.check(f"at least {total} kills", kills >= total)
    result.checks += load.checks()
    return result
