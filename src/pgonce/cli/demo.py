"""Prove exactly-once on the spot: a retry storm against an order-taking handler.

Every order is delivered many times at once over a pool of connections, in random order; some
attempts crash after writing the order (their transaction rolls back, the key is freed). Each
delivery goes through the key store: the claim, the order row and the stored response commit in one
transaction. The orders table has no unique constraint: exactly-once comes from pgonce alone.
At the end the demo counts the rows and compares every response with the first.

With --url, the demo fires a signed webhook retry storm at a running `pgonce serve` instead: the
first configured source with a handler (--config), every order delivered --copies times at once;
it then counts the handler's rows (pgonce.service.demo:record_order writes them) in the database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from psycopg import sql

from pgonce.cli.common import (
    add_database_options,
    announced_database,
    bounded_int,
    database,
    print_proof,
    say,
)
from pgonce.cli.serve import fire_storm, service_config
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Response
from pgonce.extras import needs, require
from pgonce.store._async.keys import AsyncKeyStore

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

NAME = "demo"
HELP = "run a retry storm through the key store and print the exactly-once proof"

DEMO_SCHEMA = "pgonce_demo"
# A business table without a unique constraint on the order: duplicates would show up as rows.
CREATE_TABLE = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.orders (
    id          bigserial PRIMARY KEY,
    run_id      uuid NOT NULL,
    order_ref   text NOT NULL,
    amount      integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
)
"""


class SimulatedCrash(Exception):
    """A handler that dies after its business write, before the response is stored."""


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    responses: dict[str, set[bytes]] = field(default_factory=dict)


#: The largest storm (orders times copies): each delivery is a task held in memory until the end.
MAX_DELIVERIES = 100_000
#: The largest pool: each connection takes one of the server's connection slots from its clients.
MAX_CONNECTIONS = 1_000


def crash_rate(value: str) -> float:
    """An argparse type: a share of first attempts, at least 0 and below 1 (all would never end)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= number < 1:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{value} is not at least 0 and below 1")
    return number


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    positive = bounded_int(1)
    parser.add_argument(
        "--orders", type=positive, default=100, help="distinct orders (default 100)"
    )
    parser.add_argument(
        "--copies",
        type=positive,
        default=10,
        help=f"deliveries of each order (default 10; orders times copies at most "
        f"{MAX_DELIVERIES:,})",
    )
    parser.add_argument(
        "--connections",
        type=positive,
        default=16,
        help=f"pool size (default 16, at most {MAX_CONNECTIONS:,})",
    )
    parser.add_argument(
        "--crash-rate",
        type=crash_rate,
        default=0.05,
        help="share of first attempts that crash after writing (default 0.05)",
    )
    service = parser.add_argument_group("against a running service")
    service.add_argument("--url", help="fire a signed webhook storm at this running pgonce serve")


def run(args: argparse.Namespace) -> int:
    # Before the database: an install without the extra is told what to add before anything is
    # started or migrated.
    require("server", "the demo")
    if args.orders * args.copies > MAX_DELIVERIES:
        args.parser.error(
            f"--orders times --copies is {args.orders * args.copies:,} deliveries, more than "
            f"{MAX_DELIVERIES:,}: a demo storm is held in memory"
        )
    if args.connections > MAX_CONNECTIONS:
        args.parser.error(
            f"--connections {args.connections:,} is more than {MAX_CONNECTIONS:,}: each takes "
            "one of the server's connection slots"
        )
    if args.url:
        config = service_config(args)
        with announced_database(config.settings, then="counting effects there") as db:
            ok = asyncio.run(
                fire_storm(config, db.dsn, args.url, args.orders, args.copies, where=db.description)
            )
        return 0 if ok else 1
    with database(args) as (settings, db):
        return asyncio.run(_storm(db.dsn, settings.schema, args))


async def _deliver(
    pool: AsyncConnectionPool,
    store: AsyncKeyStore,
    run_id: str,
    order_ref: str,
    crash_rate: float,
    tally: Tally,
) -> None:
    payload = json.dumps({"order": order_ref, "amount": 4200}).encode()
    table = sql.Identifier(DEMO_SCHEMA, "orders")
    insert = sql.SQL("INSERT INTO {} (run_id, order_ref, amount) VALUES (%s, %s, %s) RETURNING id")
    for _attempt in range(100):
        try:
            async with (
                pool.connection() as conn,
                store.once(
                    conn, f"demo:{run_id}", order_ref, fingerprint(payload), commit=True
                ) as op,
            ):
                if op.won:
                    cur = await conn.execute(insert.format(table), (run_id, order_ref, 4200))
                    row = await cur.fetchone()
                    assert row is not None
                    if random.random() < crash_rate:
                        raise SimulatedCrash
                    body = json.dumps({"order": order_ref, "id": row[0], "status": "accepted"})
                    op.respond(
                        Response(201, (("content-type", "application/json"),), body.encode())
                    )
        except SimulatedCrash:
            tally.outcomes["crashed"] += 1
            continue
        if op.in_flight:
            tally.outcomes["in flight"] += 1
            await asyncio.sleep(0.01)
            continue
        tally.outcomes["first run" if op.won else "replay"] += 1
        assert op.response is not None
        tally.responses.setdefault(order_ref, set()).add(op.response.body)
        return
    tally.outcomes["gave up"] += 1


async def _storm(dsn: str, schema: str, args: argparse.Namespace) -> int:
    with needs("server", "the demo"):
        from psycopg_pool import AsyncConnectionPool

    run_id = str(uuid.uuid4())
    store = AsyncKeyStore(schema=schema)
    async with AsyncConnectionPool(
        dsn, min_size=args.connections, max_size=args.connections, open=False
    ) as pool:
        async with pool.connection() as conn:
            await conn.execute(sql.SQL(CREATE_TABLE).format(schema=sql.Identifier(DEMO_SCHEMA)))
        refs = [f"order-{n:05d}" for n in range(args.orders)]
        deliveries = [ref for ref in refs for _ in range(args.copies)]
        random.shuffle(deliveries)
        tally = Tally()
        say(
            f"pgonce demo: {len(deliveries)} concurrent deliveries of {args.orders} orders "
            f"over {args.connections} connections"
        )
        started = time.perf_counter()
        await asyncio.gather(
            *(_deliver(pool, store, run_id, ref, args.crash_rate, tally) for ref in deliveries)
        )
        elapsed = time.perf_counter() - started
        async with pool.connection() as conn:
            cur = await conn.execute(
                sql.SQL(
                    "SELECT count(*), count(DISTINCT order_ref) FROM {} WHERE run_id = %s"
                ).format(sql.Identifier(DEMO_SCHEMA, "orders")),
                (run_id,),
            )
            row = await cur.fetchone()
            assert row is not None
            rows, distinct = row
    identical = all(len(bodies) == 1 for bodies in tally.responses.values())
    ok = rows == distinct == args.orders and identical and not tally.outcomes["gave up"]
    o = tally.outcomes
    lines = [
        ("deliveries", len(deliveries), "each order sent concurrently, in random order"),
        ("unique orders", args.orders, ""),
        ("side effects", rows, f"rows in {DEMO_SCHEMA}.orders for this run"),
        ("first runs", o["first run"], "claim won, order written, response stored"),
        ("replays", o["replay"], "stored response returned verbatim, nothing written"),
        ("in flight", o["in flight"], "original still running: told to retry, then replayed"),
        ("crashed mid-work", o["crashed"], "order written, then the handler died: rolled back"),
        ("identical responses", "yes" if identical else "NO", "every order: one response body"),
    ]
    print_proof(lines, seconds=elapsed, items=len(deliveries), ok=ok)
    return 0 if ok else 1
