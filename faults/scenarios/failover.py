"""The primary taken away on a pg_auto_failover formation under load: a graceful failover and a
kill -9 of the primary's node.

The suite starts a monitor and two PostgreSQL nodes (synchronous replication) of its own
(:mod:`faults.cluster`), once for both cases; the service (webhook receiver, inbox workers,
relay) and the payments app connect with the multi-host DSN ``host=127.0.0.1,127.0.0.1
port=P1,P2 target_session_attrs=read-write``, so that libpq finds whichever node accepts writes.
Under the mixed load (webhooks, payments, outbox) plus two probes that time every answer, the
scenario

- **graceful**: runs ``pg_autoctl perform failover`` (the primary drains and is demoted, the
  secondary promoted);
- **kill**: kills the primary's node with SIGKILL (its pg_autoctl, PostgreSQL and every backend),
  waits for the monitor to promote the secondary, then starts the killed node again so that it
  rejoins as the secondary.

Figures: the longest time without a success (200 for a webhook, 201 for a payment) and the
longest wait for any answer, as the probes saw them; the time pg_auto_failover took until the new
primary committed a write; and the time from that moment until pgonce answered 200 and 201 again.
Checks: nothing acknowledged lost, nothing doubled, no 500, pgonce answered again without being
restarted, and the formation had a synchronous secondary again at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from faults.cluster import Formation, formation, prepare
from faults.context import Context
from faults.load import MIXED_LOAD, PaymentLoad, WebhookLoad
from faults.probe import Probes, Timeline
from faults.report import Result

#: Probe successes to see before the fault (the processes warm) and after the recovery.
SUCCESSES_AROUND = 20
#: How long pgonce may take to answer again once the new primary accepts writes.
RECOVERY_TIMEOUT = 120.0
#: How often the former secondary is asked whether it commits a write yet.
WRITABLE_POLL = 0.05

PROBES = (
    "two probes, one request at a time each (a webhook until its 200, a payment until its "
    "201, retried with the same id or key after a transport error or a 10 s timeout), timing "
    "every answer"
)


async def graceful(ctx: Context) -> Result:
    return await _failover(ctx, kill=False)


async def kill_primary(ctx: Context) -> Result:
    return await _failover(ctx, kill=True)


async def _successes(timelines: list[Timeline], count: int, after: float, within: float) -> bool:
    """Wait (bounded) until every timeline has ``count`` successes answered after ``after``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(sum(1 for t in tl.successes() if t > after) >= count for tl in timelines):
            return True
        await asyncio.sleep(0.05)
    return False


async def _writable(cluster: Formation, name: str, within: float) -> float | None:
    """The moment (monotonic) node ``name`` first committed a write, or None after ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await cluster.writable(name):
            return time.monotonic()
        await asyncio.sleep(WRITABLE_POLL)
    return None


def _formation() -> contextlib.AbstractContextManager[Formation]:
    """The formation of both cases, with pgonce's schema in its database."""

    @contextlib.contextmanager
    def started() -> Iterator[Formation]:
        with formation("failover") as cluster:
            prepare(cluster.dsn())
            yield cluster

    return started()


async def _failover(ctx: Context, *, kill: bool) -> Result:
    case = "kill" if kill else "graceful"
    run = f"failover_{case}"
    # One formation for both cases (its start is most of a case's time); each case has its own
    # run id, payment amounts and outbox aggregate type, so that each counts only its own.
    cluster = await asyncio.to_thread(ctx.shared, "failover", _formation)
    await asyncio.to_thread(cluster.wait_healthy)
    amounts = 2_000_000 if kill else 1_000_000
    dsn = cluster.dsn()
    with ctx.processes() as procs:
        served = ctx.serve(procs, run, dsn, amounts=amounts)
        load = served.load
        probes = Probes(
            WebhookLoad(load.hooks.url, f"{run}_probe", ctx.scheme),
            PaymentLoad(load.pays.url, f"{run}_probe", amounts + 500_000),
        )
        timelines = [probes.webhooks, probes.payments]
        load.start()
        probes.start()
        began = time.monotonic()
        warm = await _successes(timelines, SUCCESSES_AROUND, began, RECOVERY_TIMEOUT)
        old = await asyncio.to_thread(cluster.primary)
        new = cluster.other(old)
        fault_at = time.monotonic()
        # The fault lasts until the formation is whole again: a relay batch cut by it may be
        # published twice (same message id), which the outbox's accounting allows then.
        with load.faults.window(f"{case} failover"):
            if kill:
                await asyncio.to_thread(cluster.kill, old)
                writable_at = await _writable(cluster, new, RECOVERY_TIMEOUT)
            else:
                failing_over = asyncio.create_task(asyncio.to_thread(cluster.perform_failover))
                writable_at = await _writable(cluster, new, RECOVERY_TIMEOUT)
                await failing_over
            promoted = writable_at if writable_at is not None else time.monotonic()
            recovered = await _successes(timelines, 1, promoted, RECOVERY_TIMEOUT)
            answered = {tl.name: tl.first_success_after(promoted) for tl in timelines}
            if kill:
                await asyncio.to_thread(cluster.restart, old)
            restarted = time.monotonic() - fault_at
            await asyncio.to_thread(cluster.wait_healthy)
            rejoined = time.monotonic() - fault_at
        after = await _successes(timelines, SUCCESSES_AROUND, time.monotonic(), 60)
        ended = time.monotonic()
        events = await asyncio.to_thread(cluster.events)
        await probes.stop()
        acc = await load.finish(dsn, ctx.redis_url, within=ctx.size(60, 30))
        for probe in (probes.hooks, probes.pays):
            part = await asyncio.to_thread(probe.account, dsn)
            acc.add(part)
            acc.notes.append(f"probe {part.summary()}")
        replays_differ = await probes.pays.replays_differ()
        untouched = served.untouched()
    ctx.bodies.extend(load.bodies + probes.hooks.bodies + probes.pays.bodies)
    result = Result(
        f"failover on pg_auto_failover: {case}",
        f"{MIXED_LOAD}; {PROBES}; the service and the app on the DSN `{dsn}`",
        (
            "`pg_autoctl perform failover` (the primary drains and is demoted, the secondary "
            "promoted)"
            if not kill
            else "SIGKILL of the primary's node (pg_autoctl, PostgreSQL and every backend), "
            "the secondary promoted by the monitor, the killed node started again to rejoin"
        ),
    )
    result.acc = acc
    took = (promoted - fault_at) if writable_at is not None else None
    longest = {tl.name: tl.longest_without_success(fault_at, ended) for tl in timelines}
    waits = {tl.name: tl.longest_wait() for tl in timelines}
    errors = {tl.name: tl.transport_errors() for tl in timelines}
    result.acc.notes += [
        "figures: "
        + (
            f"new primary ({new}) committed a write {took:.1f} s after the fault"
            if took is not None
            else f"the new primary ({new}) never committed a write"
        )
        + "; pgonce answered again "
        + ", ".join(
            f"{name} {'never' if s is None else f'{s:.2f} s'}" for name, s in answered.items()
        )
        + " after that; longest time without a success: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in longest.items())
        + "; longest wait for any answer: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in waits.items())
        + "; probe transport errors (retried): "
        + ", ".join(f"{name} {n}" for name, n in errors.items())
        + f"; a synchronous secondary again {rejoined:.1f} s after the fault"
        + (f" (the killed node started again at {restarted:.1f} s)" if kill else ""),
        "pg_auto_failover events: " + "; ".join(events[-12:]),
    ]
    result.check(
        f"the load ran before the fault ({SUCCESSES_AROUND} successes of each probe)", warm
    )
    result.check(f"the new primary ({new}) committed a write", writable_at is not None)
    result.check(
        "pgonce answered 200 and 201 again after the new primary accepted writes "
        f"(within {RECOVERY_TIMEOUT:.0f} s), and went on answering",
        recovered and after,
    )
    result.check("no process was restarted: each was started once and still runs", untouched)
    result.check(
        "every probe payment's key replays its first 201 byte for byte", replays_differ == 0
    )
    result.checks += load.checks()
    return result
