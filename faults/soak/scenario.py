"""One soak run on the fault suite's context: start the systems, drive the phases, account.

Accounting is the fault suite's (faults/load.py): from the database and the broker, never from
the producers' counters; each item is attributed to the phase it was sent in, so that a phase's
lost and doubled are its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
import redis
from psycopg_pool import AsyncConnectionPool

from faults.context import Context
from faults.load import Accounting, FaultLog, OutboxLoad, PaymentLoad, WebhookLoad, combine
from faults.proxy import free_port
from faults.report import Result
from faults.soak.phases import HELD_CONNECTIONS, Target
from faults.soak.run import (
    PGQ_WORKERS,
    Paths,
    PhaseRun,
    Recorder,
    Sample,
    drive,
    phase_runs,
)
from pgonce.config import own_connect_kwargs
from pgonce.relay import DEFAULT_CONCURRENCY

#: The service's sweeper runs as in production, at a shorter pace so that a short profile sees
#: several of its runs (retention stays the default: nothing young is deleted).
SWEEPER_CONFIG = '\n[sweeper]\nevery = "10s"\n'


@dataclass(frozen=True)
class Profile:
    name: str
    #: Seconds of the baseline and recovery phases, and of every other (stress) phase.
    calm: float
    stress: float
    #: Arrivals per second of each path at the baseline.
    rate: float
    what: str


#: Arrivals per second of each path at the baseline (four paths: 24 arrivals/s in all, 36 in
#: high-load): what one harness process sustains on a 2-core machine shared with other work
#: without falling behind its schedule, so that the rate offered is the rate intended.
RATE = 6.0
#: The long profile's rate: twice the short one's, for a person's run on a machine left to it (a
#: quiet 2-core machine sustained 20/s per path, 30 in high-load, without falling behind). Over
#: a 10-minute pinned horizon it leaves 7,200 dead versions per table that nothing can reclaim:
#: enough for the hot tables and their indexes to grow where they would in production.
LONG_RATE = 12.0

PROFILES = {
    p.name: p
    for p in (
        Profile("short", 15, 15, RATE, f"15 s per phase, {RATE:g} arrivals/s per path"),
        Profile("medium", 60, 150, RATE, "60 s baseline/recovery, 150 s per stress phase"),
        Profile(
            "long",
            300,
            600,
            LONG_RATE,
            f"5 minutes baseline/recovery, 10 minutes per stress phase, {LONG_RATE:g} arrivals/s "
            "per path",
        ),
    )
}
DEFAULT_PHASES = [
    "baseline",
    "idle-in-tx",
    "high-load",
    "active-readers",
    "pg-backend-kill",
    "pool-exhaustion",
    "recovery",
]
CALM = {"baseline", "recovery"}
#: Reads of the broker's stream for the accounting before the run counts as failed.
ACCOUNT_TRIES = 3


@dataclass
class SoakRun:
    """Everything the report needs."""

    profile: Profile
    phases: list[PhaseRun]
    samples: list[Sample]
    result: Result
    pgq: Accounting
    pgq_notes: list[str] = field(default_factory=list)
    started: float = 0.0


async def _account_outbox(
    outbox: OutboxLoad, dsn: str, redis_url: str, faults: FaultLog
) -> tuple[Accounting, list[tuple[str, bool]]]:
    """The outbox's accounting, its read of the stream tried again when Redis is slow to answer
    (a machine busy with other work): that read comes before anything is consumed, so a second
    try counts nothing twice."""
    for attempt in range(ACCOUNT_TRIES):
        try:
            return await outbox.account(
                dsn, redis_url, faults, relay_loops=DEFAULT_CONCURRENCY, within=60
            )
        except redis.exceptions.TimeoutError:
            if attempt == ACCOUNT_TRIES - 1:
                raise
            print("soak: Redis did not answer the stream's read in time; reading again", flush=True)
    raise AssertionError("unreachable")


def _per_item(counts: dict[int, int], acked: set[int], first: int, last: int) -> tuple[int, int]:
    lost = sum(1 for n in range(first, last) if n in acked and n not in counts)
    doubled = sum(counts[n] - 1 for n in range(first, last) if counts.get(n, 0) > 1)
    return lost, doubled


def _counts(dsn: str, query: str, params: tuple[Any, ...]) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        return {int(k): int(n) for k, n in conn.execute(query, params).fetchall()}


def attribute(
    phases: list[PhaseRun],
    dsn: str,
    pgq_runs: Counter[int],
    pgq_committed: set[int],
    hooks: WebhookLoad,
    pays: PaymentLoad,
    outbox: OutboxLoad,
) -> None:
    """Each phase's lost and doubled, per path, from the effects in the database."""
    hook_counts = _counts(
        dsn,
        "SELECT substr(order_ref, 3)::bigint, count(*) FROM pgonce_demo.webhook_orders "
        "WHERE run_id = %s GROUP BY order_ref",
        (hooks.run,),
    )
    pay_counts = _counts(
        dsn,
        "SELECT amount - %s, count(*) FROM payments WHERE principal = 'alice' AND amount >= %s "
        "GROUP BY amount",
        (pays.base, pays.base),
    )
    effects = _counts(
        dsn,
        "SELECT message_id::bigint, count(*) FROM faults_outbox_effects WHERE run = %s "
        "GROUP BY message_id",
        (outbox.run,),
    )
    for run in phases:
        for path, counts, acked in (
            ("webhooks", hook_counts, hooks.acked),
            ("payments", pay_counts, set(pays.first)),
            ("pgqueuer", dict(pgq_runs), pgq_committed),
        ):
            first, last = run.items.get(path, (0, 0))
            run.lost[path], run.doubled[path] = _per_item(counts, acked, first, last)
        run.lost["inbox"] = run.lost["webhooks"]
        run.doubled["inbox"] = run.doubled["webhooks"]
        run.lost["outbox"] = sum(1 for i in run.outbox_ids if i not in effects)
        run.doubled["outbox"] = sum(effects[i] - 1 for i in run.outbox_ids if effects.get(i, 0) > 1)


async def soak(
    ctx: Context,
    profile: Profile,
    names: list[str],
    *,
    seconds: float | None = None,
    rate: float | None = None,
) -> SoakRun:
    """Run the phases ``names`` of ``profile`` (``seconds``: every phase this long instead;
    ``rate``: arrivals per second and path at the baseline instead of the profile's)."""
    if rate is not None:
        profile = replace(profile, rate=rate, what=f"{profile.what}; {rate:g} arrivals/s per path")
    if seconds is not None:
        profile = replace(profile, what=f"{profile.what}; {seconds:g} s per phase")
    dsn = ctx.database("soak")
    pgq_dsn = ctx.pg.database("soak_pgq")
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    async with await psycopg.AsyncConnection.connect(pgq_dsn, autocommit=True) as conn:
        await Queries(PsycopgDriver(conn)).install()
    run_id = f"soak{int(time.time())}"
    phases = phase_runs(names, profile.rate)
    samples: list[Sample] = []
    began = time.time()
    with ctx.processes() as procs:
        port, pay_port = free_port(), free_port()
        procs.service("soak-service", dsn, port, ctx.redis_url, extra=SWEEPER_CONFIG)
        procs.payments("soak-payments", dsn, pay_port)
        ctx.keep_logs(procs)
        print(f"soak: service and payments app up after {time.time() - began:.0f} s", flush=True)
        hooks = WebhookLoad(f"http://127.0.0.1:{port}/webhooks/shop", run_id, ctx.scheme)
        pays = PaymentLoad(f"http://127.0.0.1:{pay_port}/payments", run_id, 5_000_000)
        outbox = OutboxLoad(dsn, run_id)
        kwargs = own_connect_kwargs()
        outbox_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn,
            min_size=2,
            max_size=8,
            open=False,
            kwargs={**kwargs, "connect_timeout": 5},
            check=AsyncConnectionPool.check_connection,
        )
        pgq_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            pgq_dsn,
            min_size=2,
            max_size=8,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": 5},
            check=AsyncConnectionPool.check_connection,
        )
        await outbox_pool.open(wait=True)
        await pgq_pool.open(wait=True)
        recorder = Recorder(phases)
        paths = Paths(
            recorder=recorder,
            hooks=hooks,
            pays=pays,
            outbox=outbox,
            outbox_pool=outbox_pool,
            pgq_pool=pgq_pool,
            pgq_dsn=pgq_dsn,
            pgonce_dsn=dsn,
            redis_url=ctx.redis_url,
        )
        targets = [
            Target(dsn, ["pgonce.keys", "pgonce.inbox", "pgonce.outbox"]),
            Target(pgq_dsn, ["pgqueuer"]),
        ]
        faults = FaultLog()
        try:
            await drive(
                phases,
                seconds=lambda r: (
                    seconds or (profile.calm if r.phase.name in CALM else profile.stress)
                ),
                paths=paths,
                targets=targets,
                faults=faults,
                samples=samples,
                rate=profile.rate,
            )
        finally:
            await paths.close()
            await outbox_pool.close()
            await pgq_pool.close()
        print(f"soak: phases and drain done after {time.time() - began:.0f} s", flush=True)
        replays_differ = await pays.replays_differ()
        unresolved = await asyncio.to_thread(hooks.unresolved, dsn)
        outbox_acc, outbox_checks = await _account_outbox(outbox, dsn, ctx.redis_url, faults)
    ctx.bodies.extend(hooks.bodies + pays.bodies)
    acc = combine(
        await asyncio.to_thread(hooks.account, dsn),
        await asyncio.to_thread(pays.account, dsn),
        outbox_acc,
    )
    print(f"soak: accounted after {time.time() - began:.0f} s", flush=True)
    attribute(phases, dsn, paths.pgq_runs, set(paths.pgq_committed), hooks, pays, outbox)
    result = Result(
        f"soak ({profile.name}): {', '.join(names)}",
        f"open loop at {profile.rate:g}/s per path (× 1.5 in high-load): Idempotency-Key "
        "payments, signed webhooks with the demo handler, outbox rows relayed to Redis; "
        "pgqueuer no-op jobs beside",
        "; ".join(f"{r.phase.name}: {r.phase.what}" for r in phases),
        acc=acc,
    )
    ran = [r for r in phases if r.ended > r.began]
    result.check(f"every phase ran ({len(ran)} of {len(phases)})", len(ran) == len(phases))
    for run in phases:
        name = run.phase.name
        if name == "idle-in-tx":
            result.check(f"{run.label}: a transaction held open per database", run.fault.done == 2)
        elif name == "active-readers":
            result.check(
                f"{run.label}: the readers scanned ({run.fault.done} scans)", run.fault.done > 0
            )
        elif name == "pg-backend-kill":
            result.check(f"{run.label}: backends terminated ({run.fault.done})", run.fault.done > 0)
        elif name == "pool-exhaustion":
            result.check(
                f"{run.label}: {HELD_CONNECTIONS} idle connections held ({run.fault.done})",
                run.fault.done == HELD_CONNECTIONS,
            )
    minimum = 3
    result.check(
        f"the load proves something: at least {minimum} events, payments and outbox rows "
        f"acknowledged (got {len(hooks.acked)}, {len(pays.first)}, {len(outbox.committed)})",
        min(len(hooks.acked), len(pays.first), len(outbox.committed)) >= minimum,
    )
    result.check(
        "every event and payment was acknowledged in the end",
        len(hooks.acked) == hooks.next and len(pays.first) == pays.next,
    )
    result.check("every acknowledged payment's key replays its first 201", replays_differ == 0)
    result.check("no inbox event left pending, failed or dead", unresolved == 0)
    result.checks += outbox_checks
    pgq_lost = sum(1 for n in paths.pgq_committed if n not in paths.pgq_runs)
    pgq = Accounting(
        label="pgqueuer",
        sent=paths.pgq_next,
        acknowledged=len(paths.pgq_committed),
        effects=len(paths.pgq_runs),
        lost=pgq_lost,
        doubled=sum(n - 1 for n in paths.pgq_runs.values() if n > 1),
    )
    notes = [
        f"pgqueuer: {PGQ_WORKERS} QueueManagers restarted {paths.pgq_restarts} times after "
        f"their connection died; {paths.pgq_failed} enqueues failed and were retried"
    ]
    return SoakRun(profile, phases, samples, result, pgq, notes, began)


#: The quick form (`make faults FAULTS_ARGS=--quick`, the test suite): seconds per phase and
#: arrivals per second and path, small enough for two minutes on a busy 2-core machine.
QUICK_SECONDS = 5.0
QUICK_RATE = 4.0


async def scenario(ctx: Context) -> Result:
    """The soak as a fault scenario (`make faults`): every phase, short; its report's row shows
    the phases' lost, doubled and 500 together, and faults/results/soak-short.md is not
    written (`make soak` writes it)."""
    if ctx.quick:
        short = PROFILES["short"]
        run = await soak(ctx, short, DEFAULT_PHASES, seconds=QUICK_SECONDS, rate=QUICK_RATE)
    else:
        run = await soak(ctx, PROFILES["short"], DEFAULT_PHASES)
    return run.result
