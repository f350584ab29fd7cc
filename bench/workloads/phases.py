"""A two-phase request against the one-transaction request and the same handler without pgonce.

One handler, the issue's POST /payments: a payment row, a charge at a payment provider
(``pgonce.testing.FakeProvider``, a real HTTP server on loopback with its own Idempotency-Key),
the charge recorded on the row. Called in a loop from one thread on one autocommit connection,
each call with a new key, three ways:

- ``without pgonce``: the row's INSERT and UPDATE commit on their own, the provider between them;
- ``one transaction``: ``once(commit=True)``: the claim, the row, the provider call, the update and
  the stored answer in one transaction, which stays open across the provider call;
- ``two-phase``: ``pgonce.phases``: the claim with its lease commits at once, then the row
  (phase "create"), the provider's result (call "charge") and the answer with the update, each
  in a short transaction of its own: four commits, none open across the call.

The figure of interest is what each phase's commit costs: the difference per request against
the one-transaction request, next to the difference of both against the bare handler. Rounds are
interleaved (the order reversed every other round); each variant's best round is reported.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from bench.context import BenchContext
from bench.report import Table
from pgonce import KeyStore, Response, fingerprint
from pgonce.phases import PhasedOperation, PhaseStore
from pgonce.testing import FakeProvider, charge

TITLE = "Two-phase requests: against one transaction and the handler without pgonce"
TABLE = "bench_phase_payments"
SCOPE = "bench-phases"
VARIANTS = ("bare", "one", "two")
LABELS = {"bare": "without pgonce", "one": "one transaction", "two": "two-phase"}
#: Transactions each variant commits per request (the bare handler's two autocommit statements).
COMMITS = {"bare": 2, "one": 1, "two": 4}
INSERT = f"INSERT INTO {TABLE} (key, amount) VALUES (%s, 100)".encode()
UPDATE = f"UPDATE {TABLE} SET charge = %s WHERE key = %s".encode()

Call = Callable[[psycopg.Connection[Any], str], Any]


def _variants(provider: FakeProvider) -> dict[str, Call]:
    keys, phases = KeyStore(), PhaseStore()

    def bare(conn: psycopg.Connection[Any], key: str) -> Any:
        conn.execute(INSERT, (key,))
        made = charge(provider.url, key, payment=key, amount=100)
        conn.execute(UPDATE, (made["id"], key))
        return made

    def one(conn: psycopg.Connection[Any], key: str) -> Any:
        with keys.once(conn, SCOPE, key, fingerprint(key), commit=True) as op:
            if op.won:
                conn.execute(INSERT, (key,))
                made = charge(provider.url, key, payment=key, amount=100)
                conn.execute(UPDATE, (made["id"], key))
                op.respond(Response(201, body=made["id"].encode()))
        return op.response

    def two(conn: psycopg.Connection[Any], key: str) -> Any:
        def pay(op: PhasedOperation[Any]) -> Response:
            op.phase("create", lambda c: c.execute(INSERT, (key,)) and None)
            made = op.call(
                "charge",
                lambda idempotency_key: charge(
                    provider.url, idempotency_key, payment=key, amount=100
                ),
            )
            return Response(201, body=made["id"].encode())

        op = phases.start(conn, SCOPE, key, fingerprint(key))
        return op.run(pay)

    return {"bare": bare, "one": one, "two": two}


def _loop(call: Call, conn: psycopg.Connection[Any], seconds: float) -> tuple[float, float]:
    """Requests per second for ``seconds``, each with a new key; this process's CPU per request
    in µs (the client's Python and the fake provider's, which runs in a thread of it)."""
    requests = 0
    call(conn, uuid.uuid4().hex)
    deadline = time.perf_counter() + seconds
    started, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() < deadline:
        for _ in range(10):
            call(conn, uuid.uuid4().hex)
        requests += 10
    return requests / (time.perf_counter() - started), (time.process_time() - cpu) / requests * 1e6


def run(ctx: BenchContext) -> list[Table]:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        columns = "(key text PRIMARY KEY, amount int NOT NULL, charge text)"
        conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} {columns}".encode())
        conn.execute(f"TRUNCATE {TABLE}".encode())
    rounds = ctx.pick(5, short=3, quick=1)
    seconds = ctx.seconds(2)
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with FakeProvider() as provider, psycopg.connect(ctx.dsn, autocommit=True) as conn:
        calls = _variants(provider)
        for number in range(rounds):
            for variant in VARIANTS if number % 2 == 0 else VARIANTS[::-1]:
                rate, spent = _loop(calls[variant], conn, seconds)
                results.setdefault(variant, []).append(rate)
                cpu.setdefault(variant, []).append(spent)
        conn.execute(f"TRUNCATE {TABLE}".encode())
        conn.execute(f"DELETE FROM {ctx.schema}.keys WHERE scope = %s".encode(), (SCOPE,))
    best = {k: max(v) for k, v in results.items()}
    micros = {k: 1e6 / v for k, v in best.items()}
    table = Table(
        TITLE,
        [
            "variant",
            "requests/s",
            "µs/request",
            "µs over the bare handler",
            "commits/request",
            "client CPU µs/request",
            "open transaction across the provider call",
        ],
    )
    for variant in VARIANTS:
        table.add(
            LABELS[variant],
            f"{best[variant]:,.0f}",
            f"{micros[variant]:,.0f}",
            "—" if variant == "bare" else f"{micros[variant] - micros['bare']:+,.0f}",
            COMMITS[variant],
            f"{statistics.median(cpu[variant]):,.0f}",
            "yes" if variant == "one" else "no",
        )
    extra = micros["two"] - micros["one"]
    per_commit = extra / (COMMITS["two"] - COMMITS["one"])
    table.notes.append(
        f"One thread, one autocommit connection to PostgreSQL on loopback, the fake provider on "
        f"loopback in a thread of the same process; {rounds} interleaved round(s) of {seconds:g} s "
        "per variant, each variant's best round; every request a new key."
    )
    table.notes.append(
        f"In this run a two-phase request took {extra:,.0f} µs more than the one-transaction "
        f"request ({per_commit:,.0f} µs for each of its {COMMITS['two'] - COMMITS['one']} extra "
        "commits, its lease and recovery points). Choose one transaction when every effect is a "
        "row in this database; the outbox when others may learn of the work after the commit; "
        "two-phase when the answer is a third party's result: it is the only one of the three "
        "whose transaction is never open across the provider's latency, and whose retry after a "
        "crash resumes from the recorded charge instead of charging again."
    )
    return [table]
