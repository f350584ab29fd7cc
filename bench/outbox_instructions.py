"""What each part of an outbox enqueue costs PostgreSQL, counted in instructions.

``.venv/bin/python -m bench.outbox_instructions`` runs the business transaction with each part of
enqueue() added on its own (the aggregate's lock row, the outbox row and its indexes, the NOTIFY
check) against the plain INSERT of Debezium's outbox pattern, on a scratch cluster under
``valgrind --tool=callgrind`` (see :mod:`bench.instructions`, whose server and counting it uses):
the server's instructions per transaction, which repeat to the thousand on a machine whose
timings move by a third, and the WAL bytes per transaction (the WAL position around the same
runs). Needs valgrind; takes about three minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.instructions import _backend, _bindir, _per_transaction, _server
from bench.workloads.outbox import BATCH_EVENTS, PAYLOAD, SETUP
from pgonce import OutboxEvent, enqueue, enqueue_many
from pgonce.config import DEFAULT_SCHEMA
from pgonce.store.migrate import migrate

BUSINESS = "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)"
FLOOR = (
    "INSERT INTO bench.outbox_floor (aggregatetype, aggregateid, type, payload)"
    " VALUES (%s, %s, %s, %s)"
)
OUTBOX_ROW = (
    "INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload) VALUES (%s, %s, %s, %s)"
)
LOCK_ROW = (
    "INSERT INTO pgonce.outbox_aggregates AS a (aggregatetype, aggregateid, events,"
    " last_enqueued_at) VALUES ('order', %s, 1, now()) ON CONFLICT (aggregatetype, aggregateid)"
    " DO UPDATE SET events = a.events + 1, last_enqueued_at = CASE"
    " WHEN excluded.last_enqueued_at >= a.last_enqueued_at + interval '1 hour'"
    " THEN excluded.last_enqueued_at ELSE a.last_enqueued_at END"
)
WAITING = (
    "SELECT pg_notify('pgonce_outbox', '') WHERE EXISTS (SELECT FROM pgonce.outbox_waiting_relays"
    " WHERE since > now() - interval '1 minute')"
)
FLOOR_MANY = (
    "INSERT INTO bench.outbox_floor (aggregatetype, aggregateid, type, payload) VALUES "
    + ", ".join(["(%s, %s, %s, %s)"] * BATCH_EVENTS)
)

Step = Callable[[psycopg.Connection[Any], str], None]
BATCHED = range(BATCH_EVENTS)


def _statement(sql: str, *extra: Any) -> Step:
    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        conn.execute(sql, (ref, *extra) if "%s" in sql else None)

    return step


def _enqueue(ordered: bool) -> Step:
    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        enqueue(conn, "order", ref, "order.created", PAYLOAD, ordered=ordered)

    return step


def _enqueue_known(conn: psycopg.Connection[Any], ref: str) -> None:
    # One of ten aggregates with events waiting (no relay runs here): its lock row exists.
    n = int(ref[1:].partition("-")[0])
    enqueue(conn, "order", f"known-{n % 10}", "order.updated", PAYLOAD)


def _enqueue_many(ordered: bool) -> Step:
    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        events = [OutboxEvent("order", ref, f"order.line.{n}", PAYLOAD) for n in BATCHED]
        enqueue_many(conn, events, ordered=ordered)

    return step


def _floor_many(table: str) -> Step:
    sql = FLOOR_MANY.replace("bench.outbox_floor", table)

    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        params: list[Any] = []
        for n in BATCHED:
            params += ["order", ref, f"order.line.{n}", Jsonb(PAYLOAD)]
        conn.execute(sql, params)

    return step


def _row(table: str) -> Step:
    sql = OUTBOX_ROW.replace("pgonce.outbox", table)

    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        conn.execute(sql, ("order", ref, "order.created", Jsonb(PAYLOAD)))

    return step


SHAPES: dict[str, list[Step]] = {
    "business transaction (BEGIN; insert; COMMIT)": [],
    "+ plain outbox INSERT (the floor)": [_row("bench.outbox_floor")],
    "+ enqueue()": [_enqueue(True)],
    "+ enqueue() of an aggregate with a lock row": [_enqueue_known],
    "+ enqueue(ordered=False)": [_enqueue(False)],
    "+ the outbox row alone (plain INSERT into pgonce.outbox)": [_row("pgonce.outbox")],
    "+ the lock row's upsert alone": [_statement(LOCK_ROW)],
    "+ the NOTIFY check alone": [_statement(WAITING)],
    f"+ plain {BATCH_EVENTS}-row INSERT (the batch's floor)": [_floor_many("bench.outbox_floor")],
    f"+ enqueue_many({BATCH_EVENTS} events)": [_enqueue_many(True)],
    f"+ enqueue_many({BATCH_EVENTS} events, ordered=False)": [_enqueue_many(False)],
    f"+ the {BATCH_EVENTS} outbox rows alone (a plain INSERT into pgonce.outbox)": [
        _floor_many("pgonce.outbox")
    ],
}


def _run(dsn: str, steps: list[Step], transactions: int) -> None:
    # Prepared from the first execution, as the bench's pool connections are after warm-up.
    with psycopg.connect(dsn, prepare_threshold=0) as conn:
        for n in range(transactions):
            ref = f"r{n}-{id(steps)}"
            with conn.transaction():
                conn.execute(BUSINESS, (ref,))
                for step in steps:
                    step(conn, ref)


def _wal_position(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _measured(dsn: str, steps: list[Step], wal: dict[int, int], transactions: int) -> None:
    """_run, noting the WAL it wrote per number of transactions.

    A checkpoint before each run: the first change of a page after a checkpoint writes the whole
    page to the WAL, so both runs start alike and their difference holds no page images that one
    run paid for the other (or a checkpoint that fell inside one of them).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    before = _wal_position(dsn)
    _run(dsn, steps, transactions)
    wal[transactions] = _wal_position(dsn) - before


def main() -> None:
    argparse.ArgumentParser(
        prog="python -m bench.outbox_instructions", description=__doc__.split("\n\n")[0]
    ).parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("bench.outbox_instructions needs valgrind (apt-get install valgrind)")
    with (
        tempfile.TemporaryDirectory(prefix="pgonce-instructions-") as tmp,
        _server(_bindir(), Path(tmp)) as (dsn, counts),
    ):
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, DEFAULT_SCHEMA)
            conn.execute(SETUP.encode())
        _backend(counts, lambda _: psycopg.connect(dsn).close(), 0, 1)
        # The first shape measured ran 40,000 instructions per transaction below the same shape
        # measured later in the same server: run one, unreported, so that every row is a later one.
        _per_transaction(counts, partial(_run, dsn, []), 1)
        print("| shape | server instructions per transaction | WAL bytes per transaction |")
        print("|---|---|---|")
        for name, steps in SHAPES.items():
            wal: dict[int, int] = {}
            cost = _per_transaction(counts, partial(_measured, dsn, steps, wal), 1)
            # As the instructions: the longer run less the shorter, per transaction.
            (long, long_wal), (short, short_wal) = sorted(wal.items(), reverse=True)
            wal_bytes = (long_wal - short_wal) / (long - short)
            print(f"| {name} | {cost:,.0f} | {wal_bytes:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
