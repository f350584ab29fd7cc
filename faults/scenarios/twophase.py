"""Two-phase payments under kill -9: each request's process killed at a random boundary or a
random moment, including in the middle of the provider call, then retried until it answers.

The payments charge through pgonce.testing.FakeProvider, which deduplicates by Idempotency-Key and
counts the charges it makes. A retry's clock is moved past the dead holder's lease, so it takes
the key over at once. At the end every payment that answered was charged exactly once at the
provider and recorded once in the database with that charge, and every client that asked again got
the same answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg

from faults.context import Context
from faults.load import Accounting
from faults.payer import AMOUNT, POINTS, request_of
from faults.procs import ROOT
from faults.report import Result
from pgonce.phases import PhaseStore
from pgonce.testing import FakeProvider

#: Where a holder dies: a boundary of the request, in the middle of the provider call, or a
#: random moment after its start.
KILLS = (*POINTS, "during-charge", "random")
#: Payments run at once: enough to overlap, few enough for a machine shared with others.
CONCURRENCY = 4
#: A retry's clock is this far ahead: past the default lease (30 s) of the holder it replaces.
AHEAD = "60"


async def two_phase_kills(ctx: Context) -> Result:
    total = ctx.size(40, 8)
    dsn = ctx.database("twophase")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE phase_payments (key text PRIMARY KEY, amount int, charge text)")
    victims: dict[str, int] = {}

    def kill_in_call(request: dict[str, Any]) -> None:
        pid = victims.pop(str(request["payment"]), None)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    answers: dict[str, list[str]] = {}
    kinds: dict[str, int] = {}
    statuses: list[str] = []
    with FakeProvider(after_charge=kill_in_call) as provider:

        def run(*args: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [sys.executable, "-m", "faults.payer", dsn, *args],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )

        def payment(n: int) -> None:
            key = f"pay-{n}"
            kind = KILLS[ctx.rng.randrange(len(KILLS))]
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "during-charge":
                first = run(key, provider.url)
                victims[key] = first.pid
            elif kind == "random":
                first = run(key, provider.url)
                time.sleep(ctx.rng.uniform(0.05, 1.0))
                first.kill()
            else:
                first = run(key, provider.url, "--crash", kind)
            first.communicate(timeout=60)
            victims.pop(key, None)
            statuses.append("killed" if first.returncode == -signal.SIGKILL else "finished")
            # Retries until one answers (a retry that met a lease tries again), then two more
            # clients asking again, from this process.
            got: list[str] = []
            for _ in range(5):
                retry = run(key, provider.url, "--ahead", AHEAD)
                out, _ = retry.communicate(timeout=60)
                lines = out.splitlines()
                outcome = json.loads(lines[-1]) if retry.returncode == 0 and lines else None
                if outcome and outcome["answer"]:
                    got.append(outcome["answer"])
                    break
            with psycopg.connect(dsn, autocommit=True) as conn:
                for _ in range(2):
                    again = PhaseStore().start(conn, "payments", key, request_of(key))
                    if again.response is not None:
                        got.append(again.response.body.decode())
            answers[key] = got

        semaphore = asyncio.Semaphore(CONCURRENCY)

        deadline = time.monotonic() + ctx.size(50, 30)
        started: list[int] = []

        async def bounded(n: int) -> None:
            async with semaphore:
                if time.monotonic() < deadline:  # the scenario's time bound: start no more
                    started.append(n)
                    await asyncio.to_thread(payment, n)

        await asyncio.gather(*(bounded(n) for n in range(total)))
        total = len(started)
        charged = provider.charged()

    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute("SELECT key, charge FROM phase_payments").fetchall()
    rows: dict[str, str | None] = dict(found)
    acc = Accounting(label="payments")
    acc.sent = total
    for key, got in answers.items():
        if got:
            acc.acknowledged += 1
            acc.statuses["201"] += 1
        count = charged.get(key, 0)
        if count:
            acc.effects += 1
        acc.doubled += max(0, count - 1)
        if got and (count == 0 or rows.get(key) is None):
            acc.lost += 1
    acc.notes.append(
        f"provider: {sum(charged.values())} charges for {len(charged)} payments, "
        f"{provider.requests} charge requests (the rest were answered from its Idempotency-Key)"
    )
    result = Result(
        "two-phase payments under kill -9",
        f"{total} POST /payments, {CONCURRENCY} at a time, each a process of its own charging "
        "through a fake provider with its own Idempotency-Key, retried until answered",
        f"one SIGKILL per payment ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})",
        acc,
    )
    one_answer = all(len(got) == 3 and len(set(got)) == 1 for got in answers.values())
    result.check("every client of a payment got the same answer", one_answer)
    recorded = all(
        json.loads(got[0])["charge"] == rows.get(key) for key, got in answers.items() if got
    )
    result.check("the stored answer's charge is the one recorded with the payment", recorded)
    result.check("every payment answered", all(answers.get(f"pay-{n}") for n in range(total)))
    result.check(
        "the provider's count: one charge per payment",
        all(charged.get(f"pay-{n}") == 1 for n in range(total)),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        stored = conn.execute("SELECT count(*), min(amount), max(amount) FROM phase_payments")
        row = stored.fetchone()
    assert row is not None
    result.check("one row per payment, each of its amount", tuple(row) == (total, AMOUNT, AMOUNT))
    return result
