"""What each part of an outbox enqueue costs PostgreSQL, counted in instructions.

``.venv/bin/python -m bench.outbox_instructions`` runs the business transaction with each part of
enqueue() added on its own (the aggregate's lock row, the outbox row and its indexes, the NOTIFY
check) against the plain INSERT of Debezium's outbox pattern, on a scratch cluster under
``valgrind --tool=callgrind`` (see :mod:`bench.instructions`, whose server and counting it uses):
the server's instructions per transaction, which repeat to the thousand on a machine whose
timings move by a third, and the WAL bytes per transaction (the WAL position around the same
runs). Needs valgrind; takes about four minutes.

The rows marked "ladder" go from the polled floor (the floor's INSERT into a table with the
relay's two pending indexes, bench/workloads/outbox.py) to ``enqueue(ordered=False)`` one part at
a time, each row the one above plus one thing, all with enqueue's typed parameters: the outbox's
other two partial indexes (published rows, dead letters), its column domains, then enqueue's own
statement without its NOTIFY check (``RETURNING id``, the clock's defaults). The next row,
``enqueue(ordered=False)``, adds the NOTIFY check; ``enqueue()`` adds the lock row. The rows
marked "not taken" are cheaper-looking forms measured beside them: the column checks as one table
CHECK constraint in place of the domains, and the order from an advisory lock in place of the
lock row (the outbox how-to says why neither is used).
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
from pgonce.sql import Queries
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

# The ladder's tables: pgonce.outbox's columns, key and four partial indexes with plain types in
# place of its domains (pgonce.outbox itself is the next rung).
LADDER_SETUP = """
CREATE TABLE bench.outbox_undomained (LIKE pgonce.outbox INCLUDING DEFAULTS INCLUDING IDENTITY);
ALTER TABLE bench.outbox_undomained
    ALTER aggregatetype TYPE text COLLATE "C", ALTER aggregateid TYPE text COLLATE "C",
    ALTER type TYPE text, ALTER headers TYPE jsonb, ALTER attempts TYPE integer,
    ADD PRIMARY KEY (id, aggregateid);
CREATE INDEX ON bench.outbox_undomained (id) WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX ON bench.outbox_undomained (aggregatetype, aggregateid, id)
    WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX ON bench.outbox_undomained (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX ON bench.outbox_undomained (aggregatetype, aggregateid)
    WHERE parked_at IS NOT NULL AND published_at IS NULL;
CREATE TABLE bench.outbox_checked (LIKE bench.outbox_undomained INCLUDING ALL,
    CHECK (octet_length(aggregatetype) BETWEEN 1 AND 255
           AND octet_length(aggregateid) BETWEEN 1 AND 512
           AND octet_length(type) BETWEEN 1 AND 255
           AND jsonb_typeof(headers) = 'object' AND attempts >= 0));
"""
# The ladder's rows as enqueue's statement types its parameters (text and jsonb casts), so that
# a domain column takes a text value, as in enqueue, not an untyped one read by the domain's input.
TYPED_ROW = (
    "INSERT INTO {table} (aggregatetype, aggregateid, type, payload)"
    " VALUES (%s::text, %s::text, %s::text, %s::jsonb)"
)
# enqueue(ordered=False)'s statement as it ships, cut before its NOTIFY check.
UNORDERED_UNCHECKED = (
    Queries("outbox", DEFAULT_SCHEMA).enqueue_unordered.decode().partition("RETURNING id")[0]
    + "RETURNING id"
)

# An alternative to the lock row, measured and not taken (see the outbox how-to): the same order
# from a transaction-level advisory lock on a hash of the aggregate, taken before the id.
_UNORDERED_HEAD, _, _UNORDERED_TAIL = (
    Queries("outbox", DEFAULT_SCHEMA).enqueue_unordered.decode().partition("VALUES (")
)
_UNORDERED_VALUES, _, _UNORDERED_RETURNING = _UNORDERED_TAIL.partition("\nRETURNING")
ADVISORY_LOCKED = (
    "WITH locked AS (SELECT pg_advisory_xact_lock(hashtextextended("
    "%(aggregatetype)s::text || E'\\x1f' || %(aggregateid)s::text, 0)))\n"
    + _UNORDERED_HEAD
    + "SELECT "
    + _UNORDERED_VALUES.rstrip()[:-1]
    + " FROM locked\nRETURNING"
    + _UNORDERED_RETURNING
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


def _typed_row(table: str) -> Step:
    sql = TYPED_ROW.format(table=table)

    def step(conn: psycopg.Connection[Any], ref: str) -> None:
        conn.execute(sql, ("order", ref, "order.created", Jsonb(PAYLOAD)))

    return step


def _enqueue_params(ref: str) -> dict[str, Any]:
    return {
        "aggregatetype": "order",
        "aggregateid": ref,
        "type": "order.created",
        "payload": Jsonb(PAYLOAD),
        "headers": None,
        "now": None,
        "channel": "pgonce_outbox",
    }


def _unordered_unchecked(conn: psycopg.Connection[Any], ref: str) -> None:
    conn.execute(UNORDERED_UNCHECKED, _enqueue_params(ref)).fetchone()


def _advisory_locked(conn: psycopg.Connection[Any], ref: str) -> None:
    conn.execute(ADVISORY_LOCKED, _enqueue_params(ref)).fetchone()


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
    "ladder: + the polled floor's INSERT (the relay's two pending indexes)": [
        _typed_row("bench.outbox_polled")
    ],
    "ladder: + the published and dead-letter indexes": [_typed_row("bench.outbox_undomained")],
    "ladder: + the column domains (a plain INSERT into pgonce.outbox)": [
        _typed_row("pgonce.outbox")
    ],
    "ladder: + RETURNING id and the clock's defaults (enqueue's statement, no NOTIFY check)": [
        _unordered_unchecked
    ],
    "ladder: + the NOTIFY check (enqueue(ordered=False))": [_enqueue(False)],
    "not taken: the column checks as one CHECK constraint (the third rung without domains)": [
        _typed_row("bench.outbox_checked")
    ],
    "not taken: enqueue() with an advisory lock on the aggregate in place of its lock row": [
        _advisory_locked
    ],
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
            conn.execute(LADDER_SETUP.encode())
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
