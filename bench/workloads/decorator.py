"""``@idempotent`` on a function, against the bare function and Powertools' idempotency utility.

One function (it inserts one row on the connection it is given and returns a small dict) three
ways, called in a loop from one thread, each call with a new key, then each call with a key just
used (a replay):

- ``bare function``: the reference; its INSERT commits on its own (an autocommit connection);
- ``pgonce @idempotent``: ``commit=True`` on the same connection: BEGIN and the claim, the
  INSERT, the stored result and COMMIT, in three round trips to PostgreSQL;
- ``Powertools @idempotent_function``: AWS Lambda Powertools' idempotency utility on its Redis
  persistence layer (``CachePersistenceLayer``, Redis on 127.0.0.1:6379): the in-progress record
  and the result in Redis, the function's INSERT committing on its own in PostgreSQL.

pgonce gives the stronger guarantee: its stored result commits in the same transaction as the
function's database writes, so a crash between the two can neither lose the result of work that
committed nor keep a result of work that rolled back; Powertools' record in Redis and the row in
PostgreSQL commit separately.

In each round the variants take turns of a tenth of a second (the order reversed every other
turn), so that a round's ratio compares calls made at the same time; each variant's best round is
reported, and the median of the rounds' ratios.
"""

from __future__ import annotations

import statistics
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import psycopg

from bench.context import BenchContext
from bench.report import Table, Targets
from pgonce import idempotent

TITLE = "@idempotent on a function: against the bare function and Powertools (Redis)"
TABLE = "bench_decorator_charges"
SCOPE = "bench-decorator"
REDIS_URL = "redis://127.0.0.1:6379/0"
#: Seconds of one variant's turn within a round. A round's pair ratio compares variants measured
#: within a fraction of a second of each other: whole rounds of one variant after the other put
#: seconds between them, and a shared machine's speed moves within seconds (the median of nine
#: pair ratios of whole rounds moved from 97 to 120 % between two runs of one commit).
TURN = 0.1
VARIANTS = ("bare", "pgonce", "powertools")
LABELS = {
    "bare": "bare function",
    "pgonce": "pgonce @idempotent",
    "powertools": "Powertools @idempotent_function, Redis",
}
INSERT = f"INSERT INTO {TABLE} (order_id, amount) VALUES (%s, %s)".encode()

Call = Callable[[psycopg.Connection[Any], dict[str, Any]], Any]


def charge(conn: psycopg.Connection[Any], order: dict[str, Any]) -> dict[str, Any]:
    """The function all three variants run: one row, a small result."""
    conn.execute(INSERT, (order["id"], order["amount"]))
    return {"order": order["id"], "amount": order["amount"], "status": "charged"}


def _pgonce() -> Call:
    return idempotent(key=lambda conn, order: order["id"], scope=SCOPE, commit=True)(charge)


def _powertools() -> Call:
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    persistence = CachePersistenceLayer(url=REDIS_URL)
    config = IdempotencyConfig(expires_after_seconds=600)
    wrapped = idempotent_function(
        data_keyword_argument="order", persistence_store=persistence, config=config
    )(charge)

    def call(conn: psycopg.Connection[Any], order: dict[str, Any]) -> Any:
        return wrapped(conn=conn, order=order)  # Powertools takes the payload by keyword

    return call


def _forget_powertools_records() -> None:
    """Delete this run's records from Redis (only ours: the server is shared); they would expire
    by themselves (``expires_after_seconds``)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in client.scan_iter(match=f"*{charge.__qualname__}#*", count=1000):
            client.delete(key)
    finally:
        client.close()


def _loop(
    call: Call,
    conn: psycopg.Connection[Any],
    seconds: float,
    stored: dict[str, Any] | None,
) -> tuple[int, float, float]:
    """Call for ``seconds``, each call with a new key or, given a ``stored`` order, repeating it;
    return the calls, the time they took and this process's CPU time over them (the Python side
    of each variant, wherever it waits)."""
    calls = 0
    deadline = time.perf_counter() + seconds
    started, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() < deadline:
        for _ in range(20):
            call(conn, stored or {"id": uuid.uuid4().hex, "amount": 1})
        calls += 20
    return calls, time.perf_counter() - started, time.process_time() - cpu


def _round(
    calls: dict[str, Call], conn: psycopg.Connection[Any], seconds: float, mode: str
) -> dict[str, tuple[float, float]]:
    """One round of one mode: the variants take turns of ``TURN`` seconds, every other turn in
    the opposite order, ``seconds`` each in all; each variant's calls per second and client CPU
    µs per call over its turns."""
    turns = max(1, round(seconds / TURN))
    done = {variant: [0, 0.0, 0.0] for variant in calls}
    stored: dict[str, dict[str, Any] | None] = dict.fromkeys(calls)
    if mode == "replay":  # a key each variant has stored, repeated through every turn
        for variant, call in calls.items():
            stored[variant] = order = {"id": uuid.uuid4().hex, "amount": 1}
            call(conn, order)
    for turn in range(turns):
        for variant in VARIANTS if turn % 2 == 0 else VARIANTS[::-1]:
            n, took, cpu = _loop(calls[variant], conn, seconds / turns, stored[variant])
            done[variant][0] += n
            done[variant][1] += took
            done[variant][2] += cpu
    return {v: (n / took, cpu / n * 1e6) for v, (n, took, cpu) in done.items()}


def run(ctx: BenchContext) -> list[Table]:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        columns = "(order_id text NOT NULL, amount int NOT NULL)"
        conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} {columns}".encode())
        conn.execute(f"TRUNCATE {TABLE}".encode())
    calls = {"bare": charge, "pgonce": _pgonce(), "powertools": _powertools()}
    # Nine rounds in the short profile too: a median of three noisy rounds moved by tens of per
    # cent from run to run, of five still between 90 and 103 % over five reports (the best rounds'
    # ratio between 93 and 112 %); the workload stays under a minute.
    rounds = ctx.pick(9, short=9, quick=1)
    seconds = ctx.seconds(2)
    results: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with warnings.catch_warnings(), psycopg.connect(ctx.dsn, autocommit=True) as conn:
        # Powertools asks for a Lambda context to bound in-progress records; none exists here.
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            for mode in ("new", "replay"):
                for variant, (rate, spent) in _round(calls, conn, seconds, mode).items():
                    results.setdefault((variant, mode), []).append(rate)
                    cpu.setdefault((variant, mode), []).append(spent)
        conn.execute(f"TRUNCATE {TABLE}".encode())
        conn.execute(f"DELETE FROM {ctx.schema}.keys WHERE scope = %s".encode(), (SCOPE,))
    _forget_powertools_records()
    best = {k: max(v) for k, v in results.items()}
    table = Table(
        TITLE,
        [
            "variant",
            "new key: calls/s",
            "µs/call",
            "client CPU µs/call",
            "replay: calls/s",
            "µs/call",
            "client CPU µs/call",
            "guarantee",
        ],
    )
    guarantee = {
        "bare": "none: a retry runs again",
        "pgonce": "result and writes in one transaction",
        "powertools": "result in Redis, writes in PostgreSQL, apart",
    }
    for variant in VARIANTS:
        new, again = best[(variant, "new")], best[(variant, "replay")]
        table.add(
            LABELS[variant],
            f"{new:,.0f}",
            f"{1e6 / new:,.0f}",
            f"{statistics.median(cpu[(variant, 'new')]):,.0f}",
            f"{again:,.0f}",
            f"{1e6 / again:,.0f}",
            f"{statistics.median(cpu[(variant, 'replay')]):,.0f}",
            guarantee[variant],
        )
    table.notes.append(
        f"One thread, one autocommit connection to PostgreSQL on loopback; {rounds} round(s) of "
        f"{seconds:g} s per variant and mode, in turns of {TURN:g} s interleaved across the "
        "variants, each variant's best round. The bare function has no replay: its replay column "
        "runs it again. Client CPU is the median round's CPU of the calling process per call: "
        "each variant's own Python work (encoding, hashing, its database or Redis client), "
        "whatever the wait on the servers."
    )
    table.notes.append(
        "pgonce gives the stronger guarantee: its stored result commits in the same PostgreSQL "
        "transaction as the function's writes, while Powertools keeps the result in Redis, "
        "apart from the writes, so a crash between the two leaves them disagreeing."
    )
    ratios = [
        results[("pgonce", "new")][i] / results[("powertools", "new")][i] for i in range(rounds)
    ]
    targets = Targets(
        f"{TITLE}: the issue's target",
        "pgonce @idempotent against Powertools @idempotent_function on Redis, from above.",
    )
    targets.table.notes.append(
        "New key, round by round: " + ", ".join(f"{100 * r:.0f}" for r in ratios) + " %."
    )
    targets.at_least(
        "pgonce vs Powertools, new key, best rounds",
        best[("pgonce", "new")] / best[("powertools", "new")],
        1.0,
    )
    targets.at_least("pgonce vs Powertools, new key, median round", statistics.median(ratios), 1.0)
    targets.at_least(
        "pgonce vs Powertools, replay, best rounds",
        best[("pgonce", "replay")] / best[("powertools", "replay")],
        1.0,
    )
    return [table, targets.table]
