"""What the client's Python costs per key-store call, counted in instructions rather than timed.

``.venv/bin/python -m bench.client_instructions DSN`` (a database pgonce migrated) runs each
variant below in a process of its own under ``valgrind --tool=callgrind``, twice: 200 and then
1,200 calls, one connection, the server wherever DSN says. The difference of the two processes'
instruction counts, over 1,000, is what one call costs the client: start-up, imports and the
warm-up cancel out. Three layers for each path, the same statements in the same round trips:

- the Python floor: the prebuilt batches on psycopg's libpq layer, one ``select()`` per round
  trip, no asyncio (what ``run_libpq_floor`` does for many connections in the keys benchmark);
- the batches alone: the same batches through pgonce's libpq layer on the event loop (uvloop),
  with no API around them;
- pgonce's API: ``once(commit=True)`` with ``op.execute()`` for a fresh key, ``once()`` for a
  replay; ``begin()`` + ``commit(writes=...)`` for a fresh key too.

The outbox's business transaction as its benchmark runs it (bench/workloads/outbox.py, one
connection): BEGIN, the business insert, then ``enqueue()`` or the ordered polled floor's plain
statement through psycopg, COMMIT; what the enqueue adds is the difference.

And the sync decorator (``@idempotent(commit=True)`` on the decorator workload's function, one
autocommit connection, as bench/workloads/decorator.py calls it), with a new key and with a key
just used, beside the bare function it decorates: what the decorator adds is the difference.

``--compiled`` counts the same calls with the once() path's own modules compiled by mypyc
(:mod:`bench.compiled`): what compiling them would save, beside what the Python costs.

Timings on a shared 2-core machine vary by a fifth from run to run; these counts repeat to a few
hundred instructions, so they show what a change to the client's path saves on any day. Needs
valgrind; takes a few minutes. ``--variant NAME --count N`` runs one variant in this process
(what each measured process does).
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence
from pathlib import Path

import psycopg
import uvloop
from psycopg import pq
from psycopg.pq.abc import PGconn, PGresult

from bench.callgrind import instructions, parser, require_valgrind
from bench.clients import Transaction, Trips, drive_async
from bench.compiled import HOT_PATH, compiled_copy
from bench.workloads import decorator, keys, outbox
from pgonce import AsyncKeyStore
from pgonce.store import wire

SHORT, LONG = 200, 1200
WARM_UP = 20

VARIANTS = (
    "fresh: Python floor",
    "fresh: batches alone",
    "fresh: once() + op.execute()",
    "fresh: begin() + commit()",
    "replay: Python floor",
    "replay: batches alone",
    "replay: once()",
    "decorator: bare function",
    "decorator: @idempotent(commit=True), new key",
    "decorator: @idempotent(commit=True), replay",
    "outbox: insert + the ordered polled floor",
    "outbox: insert + enqueue()",
)


def main() -> None:
    cli = parser("bench.client_instructions", __doc__, VARIANTS, LONG)
    cli.add_argument(
        "--compiled",
        action="store_true",
        help=f"count with {', '.join(HOT_PATH)} compiled by mypyc (needs setuptools and gcc)",
    )
    args = cli.parse_args()
    if args.variant is not None:
        _run(args.dsn, args.variant, args.count)
        return
    require_valgrind("bench.client_instructions")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(keys.SETUP.encode())
        columns = "(order_id text NOT NULL, amount int NOT NULL)"
        conn.execute(f"CREATE TABLE IF NOT EXISTS {decorator.TABLE} {columns}".encode())
        conn.execute(outbox.SETUP.encode())
    _setup_duplicates(args.dsn)
    if not args.compiled:
        _count(args.dsn, args.only, "client instructions per call")
        return
    with compiled_copy() as root:
        # The measured processes import the compiled copy first, bench from this checkout.
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parents[1])])
        _count(args.dsn, args.only, "client instructions per call, the hot path compiled")


def _count(dsn: str, only: str | None, heading: str) -> None:
    print(f"| client path | {heading} |\n|---|---|")
    for variant in VARIANTS:
        if only and only not in variant:
            continue
        long = instructions("bench.client_instructions", dsn, variant, LONG)
        short = instructions("bench.client_instructions", dsn, variant, SHORT)
        print(f"| {variant} | {(long - short) / (LONG - SHORT):,.0f} |", flush=True)


def _setup_duplicates(dsn: str) -> None:
    """The completed keys a replay reads (the keys benchmark's own, made the same way)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pgonce.keys WHERE scope = 'bench-dup'")
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                       response_status, response_headers, response_body)
               SELECT 'bench-dup', g::text, %s, now(), now(), 201,
                      '[["content-type","application/json"]]', %s
                 FROM generate_series(1, %s) AS g""",
            (keys.FP, keys.BODY, keys.DUPLICATE_KEYS),
        )


def _run(dsn: str, variant: str, count: int) -> None:
    path, layer = variant.split(": ")
    if path == "decorator":
        _decorated(dsn, layer, count)
        return
    if path == "outbox":
        _outbox(dsn, layer, count)
        return
    store = AsyncKeyStore()
    trips = keys._fresh_trips(store) if path == "fresh" else keys._duplicate_trips(store)
    if layer == "Python floor":
        _floor(dsn, trips, count)
        return
    if layer == "batches alone":
        transaction = drive_async(trips)
    elif layer.startswith("begin()"):
        transaction = keys._begin_commit(store)
    elif path == "fresh":
        transaction = keys._pgonce_queued(store, keys._run_id())
    else:
        transaction = keys._pgonce_duplicate(store)
    _on_one_connection(dsn, transaction, 0, count)


def _on_one_connection(dsn: str, transaction: Transaction, client: int, count: int) -> None:
    """``transaction`` ``count`` times (after the warm-up) on one async connection, on uvloop."""

    async def calls() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            for seq in range(-WARM_UP, count):
                await transaction(conn, client, seq)

    uvloop.run(calls())


def _decorated(dsn: str, layer: str, count: int) -> None:
    """The decorator workload's function, bare or decorated, on one autocommit connection."""
    call = decorator.charge if layer == "bare function" else decorator._pgonce()
    run = keys._run_id()
    replay = layer.endswith("replay")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for seq in range(-WARM_UP, count):
            call(conn, {"id": run if replay else f"{run}-{seq}", "amount": 1})


def _outbox(dsn: str, layer: str, count: int) -> None:
    """The outbox benchmark's business transaction, with enqueue() or its ordered polled floor."""
    transaction = outbox._enqueue(True) if "enqueue" in layer else outbox._insert_and_ordered
    run = int(keys._run_id(), 16)  # the "client" of the rows' refs: new aggregates each run
    _on_one_connection(dsn, transaction, run, count)


def _floor(dsn: str, trips: Trips, count: int) -> None:
    """The batches on psycopg's libpq layer, one connection, one select() per round trip."""
    pgconn = pq.PGconn.connect(psycopg.conninfo.make_conninfo(dsn).encode())
    if pgconn.status != pq.ConnStatus.OK:
        raise RuntimeError(pgconn.error_message.decode(errors="replace"))
    pgconn.nonblocking = 1
    prepared: set[bytes] = set()
    try:
        for seq in range(-WARM_UP, count):
            steps = trips(0, seq)
            commands = next(steps)
            try:
                while True:
                    commands = steps.send(_floor_trip(pgconn, prepared, commands))
            except StopIteration:
                pass
    finally:
        pgconn.finish()


def _floor_trip(
    pgconn: PGconn, prepared: set[bytes], commands: Sequence[wire.Command]
) -> list[PGresult]:
    pgconn.enter_pipeline_mode()
    skipped: set[int] = set()
    position = 0
    for statement, params in commands:
        if statement.name not in prepared:
            pgconn.send_prepare(statement.name, statement.sql, statement.types or None)
            prepared.add(statement.name)
            skipped.add(position)
            position += 1
        pgconn.send_query_prepared(
            statement.name, params, param_formats=statement.formats, result_format=1
        )
        position += 1
    pgconn.pipeline_sync()
    while pgconn.flush():
        pass
    results: list[PGresult] = []
    while True:
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                continue
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise RuntimeError(result.error_message.decode(errors="replace"))
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                pgconn.exit_pipeline_mode()
                return [r for n, r in enumerate(results) if n not in skipped]
            results.append(result)


if __name__ == "__main__":
    main()
