"""Key store: the fresh-key path and the duplicate path, against pgbench and raw psycopg.

References, measured in the same run at the same concurrency:
- pgbench ``naive 5``: BEGIN; claim (INSERT ... ON CONFLICT); business insert; completion; COMMIT,
  one statement per round trip -- the shape most hand-written key stores have;
- pgbench ``own shape``: the statements pgonce sends, in the same grouping -- the limit for
  pgonce's own shape, with no Python at all. One difference, in pgbench's disfavour: pgonce's
  completion reaches the claim's row by the ctid the claim returned, pgbench's through the
  primary key (pgbench cannot carry a value from one statement to the next inside a pipeline).
  callgrind on PostgreSQL 15 puts that at 17,000 of the 289,000 instructions the server runs
  for BEGIN, the claim, the completion and COMMIT (one connection);
- ``raw psycopg``: a hand-written async psycopg loop of the naive five statements.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any

import psycopg
from psycopg.pq.abc import PGresult

from bench import database_cost
from bench.clients import (
    Measurement,
    Transaction,
    Trips,
    best_alternated,
    drive_async,
    run_clients,
    run_libpq_floor,
    run_pgbench,
)
from bench.context import BenchContext
from bench.database_cost import MIDDLEWARE, Cost
from bench.report import Table, Targets, ratio
from pgonce import AsyncKeyStore, Response, fingerprint
from pgonce.store import wire

TITLE = "Key store"
LEVELS = (1, 4, 16, 64)
FP = fingerprint("POST", "/orders", b'{"amount": 4200}')
FP_HEX = FP.hex()
BODY = b'{"order":"accepted","amount":4200}'
DUPLICATE_KEYS = 10_000

SETUP = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE IF NOT EXISTS bench.orders (id bigserial PRIMARY KEY, key text NOT NULL, amount int);
"""

NAIVE5 = f"""\\set k random(1, 9000000000000000000)
BEGIN;
INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at)
  VALUES ('bench-naive', :k::text, decode('{FP_HEX}', 'hex'), now())
  ON CONFLICT (scope, key) DO NOTHING RETURNING claimed_at;
INSERT INTO bench.orders (key, amount) VALUES (:k::text, 4200);
UPDATE pgonce.keys SET completed_at = now(), response_status = 201, response_headers = '[]',
  response_body = convert_to('{BODY.decode()}', 'UTF8')
  WHERE scope = 'bench-naive' AND key = :k::text AND completed_at IS NULL;
COMMIT;
"""


def _claim_trip(scope: str, key: str) -> str:
    """begin(): BEGIN and the claim's INSERT, flushed together."""
    return f"\\startpipeline\nBEGIN;\n{claim_insert(scope, key)};\n\\endpipeline\n"


def claim_insert(scope: str, key: str) -> str:
    """begin()'s claim INSERT (queries/keys.sql) in pgbench's syntax, without its semicolon."""
    return f"""INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at)
  SELECT '{scope}', {key}, decode('{FP_HEX}', 'hex'), wait.at, wait.at
    FROM (SELECT coalesce(NULL::timestamptz, now()) AS at,
                 set_config('pgonce.lock_timeout', current_setting('lock_timeout'), true),
                 set_config('lock_timeout', '2000', true)) AS wait
  ON CONFLICT (scope, key) DO NOTHING
  RETURNING claimed_at, set_config('lock_timeout', current_setting('pgonce.lock_timeout'), true),
            ctid"""


def _read_trip(scope: str, key: str) -> str:
    """begin() after an INSERT that did nothing: the stored row and COMMIT, flushed together."""
    return f"""\\startpipeline
SELECT k.fingerprint::bytea, k.claimed_at, k.completed_at, k.response_status,
       k.response_headers, k.response_body
  FROM (VALUES (1)) AS one
  LEFT JOIN pgonce.keys AS k ON k.scope = '{scope}' AND k.key = {key};
COMMIT;
\\endpipeline
"""


def _claim_function_trip(scope: str, key: str) -> str:
    """The same round trip with the claim as one call of the claim() function (what claim() sends
    inside a caller's transaction, and what begin() sent before it had statements of its own)."""
    return f"""\\startpipeline
BEGIN;
SELECT state, fingerprint, claimed_at, completed_at,
       response_status, response_headers, response_body
  FROM pgonce.claim('{scope}', {key}, decode('{FP_HEX}', 'hex'), 2000, NULL);
\\endpipeline
"""


BUSINESS_INSERT = "INSERT INTO bench.orders (key, amount) VALUES (:k::text, 4200);\n"
# By key: pgonce's commit() reaches the row by its ctid instead (see the module's docstring).
COMPLETION = f"""UPDATE pgonce.keys
  SET completed_at = coalesce(NULL::timestamptz, completed_at, now()),
  response_status = 201, response_headers = '[["content-type","application/json"]]',
  response_body = convert_to('{BODY.decode()}', 'UTF8')
  WHERE scope = 'bench-own' AND key = :k::text AND response_headers IS NULL;
"""
FRESH_KEY = "\\set k random(1, 9000000000000000000)\n"

# What `once()` sends on an idle connection: BEGIN + claim in one flush (begin()), the block's
# business insert as its own statement (psycopg), then the completion and COMMIT in one flush
# (commit()).
OWN_FRESH = (
    FRESH_KEY
    + _claim_trip("bench-own", ":k::text")
    + BUSINESS_INSERT
    + f"\\startpipeline\n{COMPLETION}COMMIT;\n\\endpipeline\n"
)

# The same with the business insert queued (`op.execute()`): it travels with the completion and
# COMMIT, so the whole transaction is two round trips.
OWN_QUEUED = (
    FRESH_KEY
    + _claim_trip("bench-own", ":k::text")
    + f"\\startpipeline\n{BUSINESS_INSERT}{COMPLETION}COMMIT;\n\\endpipeline\n"
)

OWN_DUPLICATE = (
    f"\\set k random(1, {DUPLICATE_KEYS})\n"
    + _claim_trip("bench-dup", ":k::text")
    + _read_trip("bench-dup", ":k::text")
)

# The claim's two forms side by side, in the two-round-trip shape and on the duplicate path.
FUNCTION_QUEUED = (
    FRESH_KEY
    + _claim_function_trip("bench-own", ":k::text")
    + f"\\startpipeline\n{BUSINESS_INSERT}{COMPLETION}COMMIT;\n\\endpipeline\n"
)
FUNCTION_DUPLICATE = (
    f"\\set k random(1, {DUPLICATE_KEYS})\n"
    + _claim_function_trip("bench-dup", ":k::text")
    + "COMMIT;\n"
)

INSERT_ALONE = """\\set k random(1, 9000000000000000000)
INSERT INTO bench.orders (key, amount) VALUES (:k::text, 4200);
"""

# The business transaction without a key store, as psycopg sends it: BEGIN, the insert and COMMIT,
# one round trip each. The calibration ("about 0.54 with the naive shape") measured
# against this shape, not against a single autocommitted statement.
BUSINESS_TX = FRESH_KEY + f"BEGIN;\n{BUSINESS_INSERT}COMMIT;\n"

# The floor of any two-round-trip transaction: the business insert twice, grouped like pgonce's
# queued shape (BEGIN + insert; insert + COMMIT), with no key store at all.
TWO_TRIPS_NO_KEYS = (
    FRESH_KEY
    + f"\\startpipeline\nBEGIN;\n{BUSINESS_INSERT}\\endpipeline\n"
    + f"\\startpipeline\n{BUSINESS_INSERT}COMMIT;\n\\endpipeline\n"
)

HEADERS = (("content-type", "application/json"),)


# once() in the caller's transaction (its default): the caller's BEGIN and business insert, each
# a round trip of its own as psycopg sends them; once()'s savepoint with its claim in one round
# trip, and the completion with the savepoint's release in another; the caller's COMMIT.
ONCE_IN_TRANSACTION = (
    FRESH_KEY
    + "BEGIN;\n"
    + f"\\startpipeline\nSAVEPOINT pgonce_once;\n{claim_insert('bench-once', ':k::text')};\n"
    + "\\endpipeline\n"
    + BUSINESS_INSERT
    + "\\startpipeline\n"
    + COMPLETION.replace("'bench-own'", "'bench-once'")
    + "RELEASE SAVEPOINT pgonce_once;\n\\endpipeline\nCOMMIT;\n"
)

# A bare claim() in the caller's transaction: the claim() function (its row born incomplete, so
# its completion moves the row between the partial indexes), the business insert and complete().
BARE_CLAIM = (
    FRESH_KEY
    + f"""BEGIN;
SELECT state FROM pgonce.claim('bench-bare', :k::text, decode('{FP_HEX}', 'hex'), 2000, NULL);
{BUSINESS_INSERT}"""
    + COMPLETION.replace("'bench-own'", "'bench-bare'")
    + "COMMIT;\n"
)


# The least WAL any key store that keeps a response can write for a fresh key: the key and its
# response in one plain INSERT after the work (nothing claimed before it, so no completion), into a
# table shaped like pgonce.keys with its primary key only. No key store can serialize duplicates
# with less: whatever it claims first, it writes this row and this index entry too.
KEY_FLOOR_SETUP = """
CREATE TABLE IF NOT EXISTS bench.key_floor (
    scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, fingerprint bytea NOT NULL,
    claimed_at timestamptz NOT NULL, completed_at timestamptz, response_status integer,
    response_headers jsonb, response_body bytea, PRIMARY KEY (scope, key));
"""
KEY_FLOOR = (
    FRESH_KEY
    + f"""BEGIN;
{BUSINESS_INSERT}INSERT INTO bench.key_floor
  VALUES ('bench-own', :k::text, decode('{FP_HEX}', 'hex'), now(), now(), 201,
  '[["content-type","application/json"]]', convert_to('{BODY.decode()}', 'UTF8'));
COMMIT;
"""
)

# The least a key store that claims before the work writes in pgonce's two-round-trip grouping:
# the claim row, then the response written into it, in a plain table shaped like pgonce.keys with
# what the behaviour needs of it (the primary key that serializes duplicates, an index by age for
# the retention sweep, room for a HOT completion), and none of pgonce's statements (no domains,
# no bounded wait, no check that the row is still the caller's).
CLAIM_FLOOR_SETUP = """
CREATE TABLE IF NOT EXISTS bench.claim_floor (
    scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, fingerprint bytea NOT NULL,
    claimed_at timestamptz NOT NULL, completed_at timestamptz, response_status integer,
    response_headers jsonb, response_body bytea, PRIMARY KEY (scope, key))
    WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS claim_floor_by_age ON bench.claim_floor (claimed_at);
"""
_CLAIM_FLOOR_CLAIM = f"""\\startpipeline
BEGIN;
INSERT INTO bench.claim_floor (scope, key, fingerprint, claimed_at)
  VALUES ('bench-own', :k::text, decode('{FP_HEX}', 'hex'), now());
\\endpipeline
"""
_CLAIM_FLOOR_COMPLETION = f"""UPDATE bench.claim_floor
  SET completed_at = now(), response_status = 201,
  response_headers = '[["content-type","application/json"]]',
  response_body = convert_to('{BODY.decode()}', 'UTF8')
  WHERE scope = 'bench-own' AND key = :k::text;
COMMIT;
"""
CLAIM_FLOOR = (
    FRESH_KEY
    + _CLAIM_FLOOR_CLAIM
    + f"\\startpipeline\n{BUSINESS_INSERT}{_CLAIM_FLOOR_COMPLETION}\\endpipeline\n"
)
# The same in the middleware's three round trips (OWN_FRESH's): the app's insert a round trip of
# its own, as the bare app sends it between its BEGIN and COMMIT.
CLAIM_FLOOR_FRESH = (
    FRESH_KEY
    + _CLAIM_FLOOR_CLAIM
    + BUSINESS_INSERT
    + f"\\startpipeline\n{_CLAIM_FLOOR_COMPLETION}\\endpipeline\n"
)


# The inbox, one event at a time: stored (inbox_store(), as the receiver does), then taken and
# marked done by the worker's claim (queries/inbox.sql), each its own transaction. Beside it a
# bare queue: the same body inserted into a table with a pending index, taken with the same
# FOR UPDATE SKIP LOCKED and marked done.
EVENT_BODY = (
    b'{"type":"payment.succeeded","data":{"id":"pay_1","amount":4200,"pad":"'
    + (b"x" * 500)
    + b'"}}'
)
INBOX_SETUP = """
CREATE TABLE IF NOT EXISTS bench.queue (id bigserial PRIMARY KEY, event_id text NOT NULL,
    body bytea NOT NULL, status text NOT NULL DEFAULT 'pending', processed_at timestamptz);
CREATE INDEX IF NOT EXISTS queue_pending ON bench.queue (id) WHERE status = 'pending';
"""
_EVENT = f"convert_to('{EVENT_BODY.decode()}', 'UTF8')"
INBOX_EVENT = (
    FRESH_KEY
    + f"""SELECT ord, outcome FROM pgonce.inbox_store(ARRAY['bench-src'], ARRAY[:k::text],
    ARRAY[{_EVENT}], ARRAY['{{"content-type": "application/json"}}']::jsonb[],
    ARRAY[sha256({_EVENT})], ARRAY[NULL]::text[], ARRAY[NULL]::bigint[], NULL, 'bench_inbox');
BEGIN;
UPDATE pgonce.inbox AS u
   SET status = 'done', processed_at = now()
  FROM (SELECT i.source, i.event_id
          FROM pgonce.inbox AS i
         WHERE i.status = 'pending' AND i.source = 'bench-src' AND i.next_attempt_at <= now()
           AND (i.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM pgonce.inbox AS h
                 WHERE h.source = i.source AND h.ordering_key = i.ordering_key
                   AND h.status IN ('pending', 'dead')
                   AND (h.received_at, h.seq) < (i.received_at, i.seq)
                   AND (h.status = 'pending' OR false)))
         ORDER BY i.next_attempt_at
         LIMIT 1
           FOR UPDATE OF i SKIP LOCKED) AS c
 WHERE u.source = c.source AND u.event_id = c.event_id
RETURNING u.source, u.event_id, u.body, u.headers, u.attempts, u.received_at, u.ordering_key,
          u.version, u.next_attempt_at, u.seq;
COMMIT;
"""
)
QUEUE_EVENT = (
    FRESH_KEY
    + f"""INSERT INTO bench.queue (event_id, body) VALUES (:k::text, {_EVENT});
BEGIN;
UPDATE bench.queue SET status = 'done', processed_at = now()
 WHERE id IN (SELECT id FROM bench.queue WHERE status = 'pending' ORDER BY id LIMIT 1
                 FOR UPDATE SKIP LOCKED)
RETURNING id, event_id, body;
COMMIT;
"""
)


def _setup(ctx: BenchContext) -> None:
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        conn.execute(INBOX_SETUP)
        conn.execute(KEY_FLOOR_SETUP)
        conn.execute(CLAIM_FLOOR_SETUP)
        conn.execute("DELETE FROM pgonce.keys WHERE scope LIKE 'bench-%'")
        conn.execute("DELETE FROM pgonce.inbox WHERE source = 'bench-src'")
        conn.execute("TRUNCATE bench.orders, bench.queue, bench.key_floor, bench.claim_floor")
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                       response_status, response_headers, response_body)
               SELECT 'bench-dup', g::text, %s, now(), now(), 201,
                      '[["content-type","application/json"]]', %s
                 FROM generate_series(1, %s) AS g""",
            (FP, BODY, DUPLICATE_KEYS),
        )
        conn.execute("VACUUM ANALYZE pgonce.keys")


def _pgonce_fresh(store: AsyncKeyStore, run: str) -> Any:
    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        key = f"{run}-{client}-{seq}"
        async with store.once(conn, "bench-api", key, FP, commit=True) as op:
            await conn.execute("INSERT INTO bench.orders (key, amount) VALUES (%s, 4200)", (key,))
            op.respond(Response(201, HEADERS, BODY))

    return transaction


#: once()'s queued write and its scope, shared with the layers' prebuilt batches (_fresh_trips).
QUEUED_INSERT = "INSERT INTO bench.orders (key, amount) VALUES (%s, 4200)"
_QUEUED_SCOPE = "bench-queued"
# QUEUED_INSERT as wire.caller_command() makes it for a str parameter: the $1 form, the text
# format, the type left to the server (0).
_QUEUED_INSERT = wire.Statement(
    b"INSERT INTO bench.orders (key, amount) VALUES ($1, 4200)", (wire.TEXT,), (0,)
)


def _pgonce_queued(store: AsyncKeyStore, run: str) -> Any:
    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        key = f"{run}-{client}-{seq}"
        async with store.once(conn, _QUEUED_SCOPE, key, FP, commit=True) as op:
            op.execute(QUEUED_INSERT, (key,))
            op.respond(Response(201, HEADERS, BODY))

    return transaction


def _pgonce_duplicate(store: AsyncKeyStore) -> Any:
    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        async with store.once(
            conn, "bench-dup", _duplicate_key(client, seq), FP, commit=True
        ) as op:
            assert op.replayed

    return transaction


def _duplicate_key(client: int, seq: int) -> str:
    """One of the completed keys _setup() made, spread over the clients."""
    return str(1 + (client * 7919 + seq) % DUPLICATE_KEYS)


def _raw_naive5(run: str) -> Any:
    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        key = f"{run}-{client}-{seq}"
        await conn.execute("BEGIN")
        await conn.execute(
            "INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at) "
            "VALUES ('bench-raw', %s, %s, now()) ON CONFLICT (scope, key) DO NOTHING "
            "RETURNING claimed_at",
            (key, FP),
        )
        await conn.execute("INSERT INTO bench.orders (key, amount) VALUES (%s, 4200)", (key,))
        await conn.execute(
            "UPDATE pgonce.keys SET completed_at = now(), response_status = 201, "
            "response_headers = '[]', response_body = %s "
            "WHERE scope = 'bench-raw' AND key = %s AND completed_at IS NULL",
            (BODY, key),
        )
        await conn.execute("COMMIT")

    return transaction


def _row(
    table: Table, level: int, name: str, m: Measurement, *refs: tuple[Measurement, str]
) -> None:
    table.add(
        level,
        name,
        f"{m.tps:,.0f}",
        f"{m.p50_ms:.2f}",
        f"{m.p99_ms:.2f}",
        f"{m.cpu_us_per_tx:.0f}",
        "; ".join(ratio(m.tps, ref.tps, label) for ref, label in refs) or "reference",
    )


def run(ctx: BenchContext) -> list[Table]:
    _setup(ctx)
    seconds = ctx.seconds(5)
    levels = ctx.pick(LEVELS, short=(1, 16), quick=(1, 16))
    store = AsyncKeyStore(schema=ctx.schema)
    columns = ["conns", "client", "tx/s", "p50 ms", "p99 ms", "client CPU µs/tx", "ratio"]
    fresh = Table(
        "Key store: fresh key (claim + business insert + completion + commit)",
        columns,
        notes=[
            "pgonce = `AsyncKeyStore.once(commit=True)` on psycopg async, with the business "
            "insert run by `conn.execute()` inside the block (3 round trips: BEGIN + claim, "
            "insert, completion + COMMIT) or queued by `op.execute()` (2 round trips: the insert "
            "travels with the completion and COMMIT). Each is compared with pgbench running the "
            "same statements in the same grouping. Client CPU is the Python process's CPU time "
            "(pgbench: its own) divided by transactions. Each row is the better of two runs, "
            "every client of a level taking its turn before the next round (the machine is "
            "shared; drift between runs would otherwise show as a difference).",
        ],
    )
    duplicate = Table("Key store: duplicate (replay of a completed key)", columns)
    overhead = Table(
        "Key store: database-level overhead (pgbench only)",
        [
            "conns",
            "shape",
            "tx/s",
            "p99 ms",
            "WAL bytes/tx",
            "vs insert alone",
            "vs business transaction",
        ],
        notes=[
            "The fresh-key transaction against the business insert alone (one autocommitted "
            "statement) and against the business transaction without a key store (BEGIN; insert; "
            "COMMIT, a round trip each, as psycopg sends it), all run by pgbench. "
            "The last two rows are the two-round-trip grouping with the key store taken out (the "
            "insert twice): what the round trips alone cost; and with the least a claim before "
            "the work writes, in a plain table (see the limits of the database cost targets). "
            "The gap between the first and pgonce's own shape is the key store's work in the "
            "database: the claim row with its index "
            "entries (the random key's primary-key page among them) and the completion (a HOT "
            "update), each in the WAL that COMMIT waits to flush. WAL bytes/tx: the server's WAL "
            "position before and after the run, over its transactions (page images written "
            "after a checkpoint included).",
        ],
    )
    rounds = ctx.pick(2, short=2, quick=1)
    targets = Targets(
        "Key store: the issue's targets (16 connections, async)",
        "From the tables above: `once()` with the insert queued (the two-round-trip shape), its "
        "replay, and pgbench running pgonce's two-round-trip shape against the business "
        "transaction alone. The targets were calibrated on PostgreSQL 15: "
        "`PGONCE_BENCH_DSN=postgresql://postgres@127.0.0.1:5432/postgres` runs there.",
    )
    layers, floors, client_floors = _layers(ctx, store, seconds)
    two_trip_shape = two_trip_limit = 0.0
    targets.table.notes.append(
        "The least any Python client of psycopg reaches on the same statements (the Python "
        "floor of the layer tables below: psycopg's libpq layer on one epoll loop, no asyncio, "
        f"no API, measured in this run): a fresh key {100 * floors[0]:.0f} %, a replay "
        f"{100 * floors[1]:.0f} % of pgbench's rate; the same batches on the event loop, still "
        f"without an API, {100 * floors[2]:.0f} and {100 * floors[3]:.0f} %."
    )
    for level in levels:
        naive, own, own_queued, raw, api, queued = best_alternated(
            partial(run_pgbench, ctx.dsn, NAIVE5, level, seconds, wal=True),
            partial(run_pgbench, ctx.dsn, OWN_FRESH, level, seconds, wal=True),
            partial(run_pgbench, ctx.dsn, OWN_QUEUED, level, seconds, wal=True),
            partial(_client_run, ctx.dsn, level, seconds, lambda _: _raw_naive5(_run_id()), store),
            partial(_client_run, ctx.dsn, level, seconds, _fresh_keys(_pgonce_fresh), store),
            partial(_client_run, ctx.dsn, level, seconds, _fresh_keys(_pgonce_queued), store),
            rounds=rounds,
        )
        _row(fresh, level, "pgbench naive 5", naive)
        _row(fresh, level, "pgbench own shape (3 trips)", own, (naive, "pgbench naive 5"))
        _row(fresh, level, "pgbench own shape (2 trips)", own_queued, (naive, "pgbench naive 5"))
        _row(fresh, level, "raw psycopg naive 5", raw, (naive, "pgbench naive 5"))
        _row(
            fresh,
            level,
            "**pgonce**, insert by conn.execute",
            api,
            (naive, "pgbench naive 5"),
            (own, "pgbench own shape"),
            (raw, "raw psycopg"),
        )
        _row(
            fresh,
            level,
            "**pgonce**, insert queued by op.execute",
            queued,
            (naive, "pgbench naive 5"),
            (own_queued, "pgbench own shape"),
            (raw, "raw psycopg"),
        )
        dup_ref, dup = best_alternated(
            partial(run_pgbench, ctx.dsn, OWN_DUPLICATE, level, seconds),
            partial(_client_run, ctx.dsn, level, seconds, _pgonce_duplicate, store),
            rounds=rounds,
        )
        _row(duplicate, level, "pgbench own shape", dup_ref)
        _row(duplicate, level, "**pgonce**", dup, (dup_ref, "pgbench own shape"))
        if level == 16 or (ctx.quick and level == levels[-1]):
            alone = run_pgbench(ctx.dsn, INSERT_ALONE, level, seconds, wal=True)
            business = run_pgbench(ctx.dsn, BUSINESS_TX, level, seconds, wal=True)
            two_trips = run_pgbench(ctx.dsn, TWO_TRIPS_NO_KEYS, level, seconds, wal=True)
            claim_floor = run_pgbench(ctx.dsn, CLAIM_FLOOR, level, seconds, wal=True)
            for shape, m in (
                ("business insert alone", alone),
                ("business transaction (BEGIN; insert; COMMIT)", business),
                ("naive 5", naive),
                ("pgonce's own shape (3 trips)", own),
                ("pgonce's own shape (2 trips)", own_queued),
                ("two inserts in 2 trips, no key store (the floor of that shape)", two_trips),
                (
                    "a claim and its completion in a plain table, 2 trips (the least a claim "
                    "before the work writes)",
                    claim_floor,
                ),
            ):
                overhead.add(
                    level,
                    shape,
                    f"{m.tps:,.0f}",
                    f"{m.p99_ms:.2f}",
                    f"{m.wal_bytes_per_tx:,.0f}",
                    _times(m, alone, "insert alone"),
                    _times(m, business, "business transaction"),
                )
            if level == 16:
                two_trip_shape = _over(own_queued, two_trips)
                two_trip_limit = _over(claim_floor, two_trips)
                targets.at_least(
                    "fresh key vs pgbench's naive five statements", _over(queued, naive), 1.10
                )
                targets.at_least(
                    "fresh key vs pgbench on pgonce's own statements",
                    _over(queued, own_queued),
                    0.85,
                )
                targets.at_most("client CPU per fresh key", queued.cpu_us_per_tx, 120, "µs")
                targets.at_least(
                    "replay vs pgbench on its own statements", _over(dup, dup_ref), 0.85
                )
                targets.at_least(
                    "pgonce's shape vs the business transaction (pgbench)",
                    _over(own_queued, business),
                    0.95,
                    "×",
                )
    cost, (fresh_wal, floor_wal), cpu_limit = _database_cost(ctx, seconds)
    return [
        fresh,
        duplicate,
        overhead,
        targets.table,
        _claim_forms(ctx, seconds),
        *layers,
        cost,
        _cost_targets(fresh_wal, two_trip_shape, client_floors),
        _cost_limits(floor_wal, floors, two_trip_limit, cpu_limit),
    ]


def _database_cost(
    ctx: BenchContext, seconds: float
) -> tuple[Table, tuple[float, float], tuple[float, float]]:
    """PostgreSQL's CPU and WAL per operation, each beside its bare reference (pgbench).

    Also the WAL of a fresh key (begin() + commit()) over the business transaction's, and the
    WAL of the least a key store writes over the business transaction's (the figure's limit);
    and the CPU over the business transaction's of the least a key store that claims before the
    work costs, and of begin() + commit() (the CPU target's limit, beside pgonce's own figure).
    """
    conns = _conns(ctx)
    rounds = ctx.pick(3, short=2, quick=1)
    (
        business,
        floor,
        claim_floor,
        claim_floor_fresh,
        begin,
        begin_fresh,
        once,
        bare,
        replay,
        queue,
        inbox,
    ) = database_cost.alternated(
        ctx.dsn,
        [
            BUSINESS_TX,
            KEY_FLOOR,
            CLAIM_FLOOR,
            CLAIM_FLOOR_FRESH,
            OWN_QUEUED,
            OWN_FRESH,
            ONCE_IN_TRANSACTION,
            BARE_CLAIM,
            OWN_DUPLICATE,
            QUEUE_EVENT,
            INBOX_EVENT,
        ],
        conns,
        seconds,
        rounds,
    )
    table = Table(
        "Database cost per request",
        ["operation", "PostgreSQL CPU µs/op", "WAL bytes/op", "page images bytes/op", "CPU", "WAL"],
        notes=[
            "What each operation costs PostgreSQL, on the server's side: the CPU time of all its "
            "processes (the backends, those that exited during the run included, and the "
            "background writers) and the WAL it wrote, over the operations pgbench ran "
            f"({conns} connections, {rounds} alternating rounds of {seconds:g} s, summed). A "
            "fresh key is the business insert with the key store around it; a replay is set "
            "beside running the request again, which is what a retry costs without a key store. "
            "The inbox's event is its storage (inbox_store()) and the worker's claim, which "
            "marks it done, one event per transaction; the bare queue stores the same body in a "
            "table with a pending index and takes it with the same FOR UPDATE SKIP LOCKED. "
            "Server-wide figures: on a shared server, a neighbour's work lands in them, in every "
            "row alike (the rows take turns).",
            "WAL bytes/op are the WAL records' bytes; the full-page images (a page's first "
            "change after a checkpoint writes the whole page) stand beside them, both as "
            "`pg_waldump --stats` counts them over each run: the images follow when the "
            "checkpoints fell during the run, not what the operation writes, and the WAL ratios "
            "leave them out.",
        ],
    )

    def add(name: str, m: Cost, reference: Cost | None) -> None:
        table.add(
            name,
            f"{m.cpu_us:.0f}",
            f"{m.wal:,.0f}",
            f"{m.images:,.0f}",
            _cost_times(m.cpu_us, reference.cpu_us) if reference else "reference",
            _cost_times(m.wal, reference.wal) if reference else "reference",
        )

    add("business transaction alone (BEGIN; insert; COMMIT)", business, None)
    add(
        "the least a key store writes: the key and its response in one INSERT after the work "
        "(primary key only, nothing claimed first)",
        floor,
        business,
    )
    add(
        "the least a key store that claims before the work writes: the claim, then its "
        "response, in a plain table (primary key, index by age), pgonce's two round trips",
        claim_floor,
        business,
    )
    add(
        "the same in the middleware's three round trips (BEGIN with the claim; the insert; "
        "the response with COMMIT)",
        claim_floor_fresh,
        business,
    )
    add("fresh key, begin() + commit() (once(commit=True)), two round trips", begin, business)
    add(
        "fresh key, begin() + commit() in the middleware's three round trips",
        begin_fresh,
        business,
    )
    add("fresh key, once() in the caller's transaction", once, business)
    add("fresh key, a bare claim() + complete() (born incomplete)", bare, business)
    add("replay of a stored response (begin())", replay, business)
    add("bare queue: an event stored, taken and marked done", queue, None)
    add("inbox: an event stored (inbox_store()), claimed and marked done", inbox, queue)
    if MIDDLEWARE:
        table.add(
            "no middleware, connection from a FastAPI dependency (HTTP workload)",
            f"{MIDDLEWARE['cpu_bare']:.0f}",
            f"{MIDDLEWARE['wal_bare']:,.0f}",
            "included",
            "reference",
            "reference",
        )
        table.add(
            "pgonce, FastAPI dependency (HTTP workload)",
            f"{MIDDLEWARE['cpu']:.0f}",
            f"{MIDDLEWARE['wal']:,.0f}",
            "included",
            _cost_times(MIDDLEWARE["cpu"], MIDDLEWARE["cpu_bare"]),
            _cost_times(MIDDLEWARE["wal"], MIDDLEWARE["wal_bare"]),
        )
        table.notes.append(
            "The HTTP workload's rows: per request over that workload's best round, its "
            "PostgreSQL processes' CPU and the server's WAL, page images included (see that "
            "table)."
        )
    # The CPU target's limit in the middleware's shape: as many round trips as the bare app's.
    cpu = (claim_floor_fresh.cpu_us / business.cpu_us, begin_fresh.cpu_us / business.cpu_us)
    return table, (begin.wal / business.wal, floor.wal / business.wal), cpu


def _cost_times(value: float, reference: float) -> str:
    return f"{value / reference:.2f} ×" if reference else "n/a"


def _cost_targets(
    fresh_wal: float, two_trip_shape: float, client_floors: tuple[float, float]
) -> Table:
    """The targets of the issue on the database's cost per request, from this run."""
    targets = Targets(
        "Database cost per request: the issue's targets",
        "From this run: the middleware's rows of the HTTP workload (its PostgreSQL CPU per "
        "request over the same app's without the middleware, and its throughput, best round and "
        "median round), the WAL of the table above, pgbench's two-round-trip shape over the same "
        "two round trips without the key store (the database-level table, 16 connections), and "
        "the client's layer tables (once() over the Python floor).",
    )
    if MIDDLEWARE:
        targets.at_most(
            "PostgreSQL CPU per request, middleware vs the bare app",
            MIDDLEWARE["cpu"] / MIDDLEWARE["cpu_bare"],
            1.5,
            "×",
        )
    else:
        targets.table.add(
            "PostgreSQL CPU per request, middleware vs the bare app", "≤ 1.50 ×", "not run", "no"
        )
    targets.at_most("WAL bytes per fresh key vs the bare business transaction", fresh_wal, 2.5, "×")
    targets.at_least(
        "pgbench: pgonce's two-round-trip shape vs the same two trips without the key store",
        two_trip_shape,
        0.85,
        "×",
    )
    targets.at_least(
        "fresh key through once() + op.execute() vs the Python floor", client_floors[0], 0.90
    )
    targets.at_least("replay through once() vs the Python floor", client_floors[1], 0.85)
    for name, figure in (("best round", "best"), ("median round", "median")):
        label = f"middleware throughput vs no middleware ({name})"
        if figure in MIDDLEWARE:
            targets.at_least(label, MIDDLEWARE[figure], 0.95)
        else:
            targets.table.add(label, "≥ 95 %", "not run", "no")
    return targets.table


def _cost_limits(
    floor_wal: float,
    floors: tuple[float, float, float, float],
    two_trip_limit: float,
    cpu_limit: tuple[float, float],
) -> Table:
    """How far the targets can go, each limit measured in this run."""
    table = Table(
        "Database cost per request: the limits of the targets",
        ["figure", "target", "limit, measured", "what sets the limit"],
        notes=[
            "A limit is what the figure would be with pgonce's own work taken out, measured "
            "beside it: a target beyond its limit cannot be met by any change to pgonce's "
            "statements or Python, only by changing what is measured against what.",
        ],
    )
    table.add(
        "WAL bytes per fresh key vs the bare business transaction",
        "≤ 2.50 ×",
        f"{floor_wal:.2f} ×",
        "the key and its response written once, in one INSERT with its primary-key entry "
        "(the database cost table's second row): every key store that keeps a response writes "
        "at least that row, and a claim before the work (the only way to hold a duplicate off "
        "while the work runs) adds its completion",
    )
    claim_floor_cpu, begin_cpu = cpu_limit
    table.add(
        "PostgreSQL CPU per request, middleware vs the bare app",
        "≤ 1.50 ×",
        f"{claim_floor_cpu:.2f} × (pgonce: {begin_cpu:.2f} ×)",
        "measured where both run alone, in pgbench against the business transaction, in the "
        "middleware's three round trips, as many as the bare app's BEGIN, insert and COMMIT "
        "(the database cost table): a claim before the work and its completion in a plain "
        "table, the least a key store that holds a duplicate off while the work runs costs "
        "the server; in brackets pgonce's begin() + commit() in the same shape",
    )
    if two_trip_limit:
        table.add(
            "pgbench: pgonce's two-round-trip shape vs the same two trips without the key store",
            "≥ 0.85 ×",
            f"{two_trip_limit:.2f} ×",
            "a claim and its completion in a plain table in the same grouping (the database-level "
            "table's last row): the row that holds a duplicate off while the work runs, its "
            "primary-key and by-age entries, and the response written into it, with none of "
            "pgonce's statements",
        )
    for figure, target, batches, floor in (
        ("fresh key through once() + op.execute() vs the Python floor", 0.90, floors[2], floors[0]),
        ("replay through once() vs the Python floor", 0.85, floors[3], floors[1]),
    ):
        table.add(
            figure,
            f"≥ {100 * target:.0f} %",
            f"{100 * batches / floor:.0f} %" if floor else "n/a",
            "the same batches on the event loop with no API at all (the layer table's "
            "'batches alone' over its Python floor): what asyncio costs before pgonce's first "
            "line runs",
        )
    for name, figure in (("best round", "best"), ("median round", "median")):
        if (limit := MIDDLEWARE.get(f"limit_{figure}")) is None:
            continue
        pgonce = MIDDLEWARE.get(figure)
        table.add(
            f"middleware throughput vs no middleware ({name})",
            "≥ 95 %",
            f"{100 * limit:.0f} %" + ("" if pgonce is None else f" (pgonce: {100 * pgonce:.0f} %)"),
            "the key store's statements alone, FastAPI dependency (the HTTP workload's table): "
            "the same app and endpoint, between begin() and commit() with no middleware logic "
            "at all, over the same app without them: what the claim and the stored response "
            "cost the app in the database; in brackets pgonce's middleware, as in the targets",
        )
    return table


def _over(m: Measurement, reference: Measurement) -> float:
    return m.tps / reference.tps if reference.tps else 0.0


def _claim_forms(ctx: BenchContext, seconds: float) -> Table:
    """pgbench: the claim() function against begin()'s statements, alternated."""
    conns = _conns(ctx)
    table = Table(
        f"Key store: the claim's two forms (pgbench, {conns} connections)",
        ["path", "claim() function tx/s", "begin()'s statements tx/s", "statements vs function"],
        notes=[
            "The same round trips, the claim either as one call of the PL/pgSQL claim() function "
            "(claim() inside a caller's transaction) or as begin()'s statements (INSERT ... ON "
            "CONFLICT DO NOTHING, whose row source sets the wait; for a duplicate, the read of "
            "the stored row, sent with COMMIT). Two alternating rounds of each, the better one "
            "reported.",
        ],
    )
    for path, function, statements in (
        ("fresh key, 2 round trips", FUNCTION_QUEUED, OWN_QUEUED),
        ("duplicate", FUNCTION_DUPLICATE, OWN_DUPLICATE),
    ):
        by_function, by_statements = best_alternated(
            partial(run_pgbench, ctx.dsn, function, conns, seconds / 2),
            partial(run_pgbench, ctx.dsn, statements, conns, seconds / 2),
        )
        table.add(
            path,
            f"{by_function.tps:,.0f}",
            f"{by_statements.tps:,.0f}",
            ratio(by_statements.tps, by_function.tps, "the function"),
        )
    return table


def _fresh_trips(store: AsyncKeyStore) -> Trips:
    """The statements once() sends for a fresh key with a queued insert, in its two round trips.

    Exactly once()'s (_pgonce_queued): its scope, and the queued INSERT as op.execute() sends it
    (wire.caller_command: the parameter's type given as 0, unknown, and so the same prepared
    statement), so that the layers differ by the Python that sends them and nothing else.
    """
    insert = _QUEUED_INSERT
    headers = wire.headers_json(HEADERS)
    wait = _wait(store)
    run = _run_id()
    scope = _QUEUED_SCOPE.encode()

    def trips(client: int, seq: int) -> Generator[Sequence[wire.Command], list[PGresult], None]:
        key = f"{run}-{client}-{seq}".encode()
        claimed = yield [
            (_BEGIN, wire.NO_PARAMS),
            (store._claim_insert, (scope, key, FP, None, wait)),
        ]
        row, _ = wire.row(claimed[1])
        yield [
            (insert, (key,)),
            (store._complete_claimed, (scope, key, b"201", headers, BODY, None, row)),
            (wire.COMMIT, wire.NO_PARAMS),
        ]

    return trips


def _duplicate_trips(store: AsyncKeyStore) -> Trips:
    """The statements once() sends for a replay: BEGIN and the claim's INSERT; the stored row's
    read and COMMIT."""
    wait = _wait(store)

    def trips(client: int, seq: int) -> Generator[Sequence[wire.Command], list[PGresult], None]:
        key = _duplicate_key(client, seq).encode()
        yield [(_BEGIN, wire.NO_PARAMS), (store._claim_insert, (b"bench-dup", key, FP, None, wait))]
        yield [(store._claim_read, (b"bench-dup", key)), (wire.COMMIT, wire.NO_PARAMS)]

    return trips


def _wait(store: AsyncKeyStore) -> bytes:
    """The claim's wait parameter, as begin() sends it for the store's default wait."""
    return b"%d" % store._wait_ms


# What wire.begin_statement() gives a connection with psycopg's default transaction settings.
_BEGIN = wire.Statement(b"BEGIN")


def _begin_commit(store: AsyncKeyStore) -> Any:
    response = Response(201, HEADERS, BODY)
    run = _run_id()

    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        key = f"{run}-{client}-{seq}"
        claim = await store.begin(conn, _QUEUED_SCOPE, key, FP)
        await store.commit(conn, claim, response, writes=[(QUEUED_INSERT, (key,))])

    return transaction


#: A row of the layer tables: its name, and what measures it.
Row = tuple[str, Callable[[], Measurement]]


def _layers(
    ctx: BenchContext, store: AsyncKeyStore, seconds: float
) -> tuple[list[Table], tuple[float, float, float, float], tuple[float, float]]:
    """Where the client's CPU goes: the same statements through thinner and thinner layers.

    Also the fractions of pgbench's rate that the Python floor and the batches on the event loop
    reached: (floor fresh, floor replay, batches fresh, batches replay); and once()'s rate over
    the Python floor's (fresh key, replay).
    """
    conns = _conns(ctx)

    def thinnest(trips: Callable[[AsyncKeyStore], Trips]) -> tuple[Row, Row]:
        """The two rows without an API: the Python floor, and the batches on the event loop."""
        return (
            (
                "Python floor (psycopg.pq on one epoll, no asyncio)",
                lambda: run_libpq_floor(ctx.dsn, conns, seconds, trips(store)),
            ),
            ("batches alone (wire.async_round_trip)", client(lambda s: drive_async(trips(s)))),
        )

    def client(make: Callable[[AsyncKeyStore], Transaction]) -> Callable[[], Measurement]:
        return partial(_client_run, ctx.dsn, conns, seconds, make, store)

    fresh, fresh_ratios = _layer_table(
        ctx,
        seconds,
        f"Key store: the client's layers (fresh key, insert queued, {conns} connections)",
        "The same statements in the same two round trips, sent by `once()` with "
        "`op.execute()`, by `begin()` + `commit(writes=...)`, as prebuilt batches through "
        "pgonce's libpq layer on the event loop with no API around them, and by the Python "
        "floor: prebuilt batches on psycopg's libpq layer driven by one epoll loop, no "
        "asyncio (bench/clients.py, run_libpq_floor), the least any Python client of psycopg "
        f"pays for them. pgbench runs them too. {_layer_rounds(ctx)} alternating rounds, the "
        "best of each. "
        "Between the floor and the batches: the event loop; between the batches and once(): "
        "the key store's own Python (checks, encoding, deciding the outcome, the response).",
        (
            *thinnest(_fresh_trips),
            ("begin() + commit(writes=...)", client(_begin_commit)),
            ("once() + op.execute()", client(_fresh_keys(_pgonce_queued))),
        ),
        OWN_QUEUED,
    )
    duplicate, duplicate_ratios = _layer_table(
        ctx,
        seconds,
        f"Key store: the client's layers (duplicate, {conns} connections)",
        "A replay's two round trips (BEGIN and the claim's INSERT; the stored row's read and "
        "COMMIT) sent by `once()`, as prebuilt batches on the event loop whose answers are not "
        "even read, and by the Python floor (as above). pgbench, running the same statements, "
        f"is the row of the same name. {_layer_rounds(ctx)} alternating rounds, the best of "
        "each.",
        (
            *thinnest(_duplicate_trips),
            ("once(), a replay", client(_pgonce_duplicate)),
        ),
        OWN_DUPLICATE,
    )
    floors = (fresh_ratios[0], duplicate_ratios[0], fresh_ratios[1], duplicate_ratios[1])
    # once()'s rate over the Python floor's: the last row of each table over its first.
    over_floor = (fresh_ratios[-1] / fresh_ratios[0], duplicate_ratios[-1] / duplicate_ratios[0])
    return [fresh, duplicate], floors, over_floor


def _layer_rounds(ctx: BenchContext) -> int:
    """Rounds of each layer table: three, two in the short profile."""
    return ctx.pick(3, short=2, quick=3)


def _layer_table(
    ctx: BenchContext,
    seconds: float,
    title: str,
    note: str,
    rows: tuple[Row, ...],
    script: str,
) -> tuple[Table, list[float]]:
    """The table, and each row's fraction of pgbench's rate (in the rows' order)."""
    conns = _conns(ctx)
    table = Table(
        title,
        ["layer", "tx/s", "throughput", "client CPU µs/tx", "CPU vs the Python floor"],
        notes=[note],
    )
    *measured, own = best_alternated(
        *(run for _, run in rows),
        partial(run_pgbench, ctx.dsn, script, conns, seconds),
        rounds=_layer_rounds(ctx),
    )
    floor = measured[0]
    for name, m in [("pgbench, the same statements", own)] + [
        (name, m) for (name, _), m in zip(rows, measured, strict=True)
    ]:
        table.add(
            name,
            f"{m.tps:,.0f}",
            "reference" if m is own else ratio(m.tps, own.tps, "pgbench"),
            f"{m.cpu_us_per_tx:.0f}",
            "reference" if m is floor else f"{m.cpu_us_per_tx / floor.cpu_us_per_tx:.2f} ×",
        )
    return table, [_over(m, own) for m in measured]


def _run_id() -> str:
    """A prefix for one run's keys, so that no run meets another's."""
    return uuid.uuid4().hex[:8]


def _fresh_keys(make: Any) -> Any:
    """``make(store, run_id)`` as a ``make(store)`` that takes new keys on every call."""
    return lambda store: make(store, _run_id())


def _client_run(
    dsn: str, conns: int, seconds: float, make: Any, store: AsyncKeyStore
) -> Measurement:
    # A new transaction function for every round (a fresh key's: new keys).
    return run_clients(dsn, conns, seconds, make(store))


def _conns(ctx: BenchContext) -> int:
    """Connections of the single-level tables: 16, or 4 for a quick run."""
    return 4 if ctx.quick else 16


def _times(m: Measurement, reference: Measurement, name: str) -> str:
    if m is reference:
        return "reference"
    return f"{m.tps / reference.tps:.2f} × {name}" if reference.tps else "n/a"
