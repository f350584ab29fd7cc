"""The service's demo: a handler that records orders, and a signed retry storm to prove it.

``examples/pgonce.toml`` configures the source ``shop`` with :func:`record_order` as its handler;
``make run`` starts the service with it and fires :func:`storm` at itself: every order is
delivered several times at once, signed like a real provider would sign it. The proof counts the
deliveries the service acknowledged and the rows the handler wrote: one per order.

This is application code, as a user would write it: the handler writes through the connection it
is given, inside the transaction that marks the event done.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from psycopg import AsyncConnection, sql

from pgonce.core.inbox import InboxEvent
from pgonce.errors import ConfigError, UsageError
from pgonce.extras import needs
from pgonce.webhooks.schemes.base import SigningScheme

with needs("server", "the pgonce service"):
    import httpx
    from psycopg_pool import AsyncConnectionPool

EXAMPLE_URL = "http://127.0.0.1:8000"
TABLE = sql.Identifier("pgonce_demo", "webhook_orders")
SETUP = sql.SQL(
    "CREATE SCHEMA IF NOT EXISTS pgonce_demo; "
    "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, source text NOT NULL, "
    "event_id text NOT NULL, run_id text NOT NULL, order_ref text NOT NULL, "
    "amount integer NOT NULL, recorded_at timestamptz NOT NULL DEFAULT now())"
).format(TABLE)
# No unique constraint on purpose: a duplicate effect would show up as a second row.
INSERT = sql.SQL(
    "INSERT INTO {} (source, event_id, run_id, order_ref, amount) VALUES (%s, %s, %s, %s, %s)"
).format(TABLE)
COUNT = sql.SQL("SELECT count(*), count(DISTINCT order_ref) FROM {} WHERE run_id = %s").format(
    TABLE
)


EXISTS = sql.SQL("SELECT to_regclass('pgonce_demo.webhook_orders') IS NOT NULL")


def service_url(url: str, source: str) -> str:
    """The service's base URL from what a user gives: the base, or the source's endpoint.

    ``http://host:8000`` and ``http://host:8000/webhooks/shop`` both name the service; the storm
    appends ``/webhooks/<source>`` itself. An endpoint of another source is refused.
    """
    parsed = urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(f"--url must be the service's http(s) URL, such as {EXAMPLE_URL}")
    path = parsed.path.rstrip("/")
    prefix, sep, named = path.rpartition("/webhooks/")
    if sep and named:
        if named != source:
            raise UsageError(
                f"--url names the endpoint of source {named!r}, but the demo storms {source!r} "
                "(the first configured source with a handler): give the service's base URL"
            )
        path = prefix
    return urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


async def check_setup(conn: AsyncConnection[Any], where: str) -> None:
    """Refuse to storm when the demo handler's table is missing: every event would fail."""
    cur = await conn.execute(EXISTS)
    row = await cur.fetchone()
    if not (row and row[0]):
        raise ConfigError(
            f"the demo's table pgonce_demo.webhook_orders does not exist in {where}: start the "
            "service with `pgonce serve --demo` (it creates the table), and give pgonce demo "
            "the service's database (--dsn, or the same --config)"
        )


async def setup(conn: AsyncConnection[Any]) -> None:
    """Create the demo's own table (the application's, not pgonce's)."""
    await conn.execute(SETUP)
    await conn.commit()


async def record_order(event: InboxEvent, conn: AsyncConnection[Any]) -> None:
    """The demo handler: one row per order event, written in the event's transaction."""
    order = event.payload["data"]
    await conn.execute(
        INSERT, (event.source, event.id, order["run"], order["order"], int(order["amount"]))
    )


@dataclass(frozen=True)
class StormReport:
    deliveries: int
    answers: dict[str, int]
    orders: int
    rows: int
    distinct: int
    seconds: float

    @property
    def exactly_once(self) -> bool:
        return self.rows == self.distinct == self.orders and set(self.answers) <= {
            "stored",
            "duplicate",
        }

    def proof(self) -> list[tuple[str, object, str]]:
        """``(label, value, note)`` lines of the proof, for a table."""
        unexpected = {k: v for k, v in self.answers.items() if k not in ("stored", "duplicate")}
        return [
            ("deliveries", self.deliveries, "signed, sent concurrently, in random order"),
            ("stored", self.answers.get("stored", 0), "new events: 200 after their commit"),
            ("duplicates", self.answers.get("duplicate", 0), "same id, same body: 200, no work"),
            *((name, count, "unexpected answer") for name, count in sorted(unexpected.items())),
            ("unique events", self.orders, ""),
            ("handler effects", self.rows, "rows the handler wrote (pgonce_demo.webhook_orders)"),
        ]


async def storm(
    url: str,
    source: str,
    scheme: SigningScheme,
    pool: AsyncConnectionPool[Any],
    *,
    orders: int = 100,
    copies: int = 5,
    concurrency: int = 32,
    settle_seconds: float = 60.0,
) -> StormReport:
    """Deliver ``orders`` events ``copies`` times each to ``url``/webhooks/``source``, then wait
    (up to ``settle_seconds``) until the handler has recorded every order."""
    run = uuid.uuid4().hex[:12]
    deliveries = []
    for n in range(orders):
        body = json.dumps(
            {
                "type": "order.created",
                "data": {"run": run, "order": f"order-{n:05d}", "amount": 4200},
            },
            separators=(",", ":"),
        ).encode()
        headers = scheme.sign(body, event_id=f"evt_{run}_{n:05d}")
        headers["content-type"] = "application/json"
        deliveries.extend([(body, headers)] * copies)
    random.shuffle(deliveries)
    answers: Counter[str] = Counter()
    gate = asyncio.Semaphore(concurrency)
    endpoint = f"{url}/webhooks/{source}"
    started = time.perf_counter()

    async with httpx.AsyncClient(timeout=30) as client:

        async def send(body: bytes, headers: dict[str, str]) -> None:
            async with gate:
                for _ in range(20):  # a provider retries what was not acknowledged
                    response = await client.post(endpoint, content=body, headers=headers)
                    if response.status_code == 200:
                        answers[response.json().get("outcome", "stored")] += 1
                        return
                    if response.status_code != 503:
                        answers[f"http {response.status_code}"] += 1
                        return
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(send(body, headers) for body, headers in deliveries))

    rows = distinct = 0
    deadline = time.monotonic() + settle_seconds
    while time.monotonic() < deadline:
        async with pool.connection() as conn:
            cur = await conn.execute(COUNT, (run,))
            found = await cur.fetchone()
        rows, distinct = found if found else (0, 0)
        if distinct >= orders:
            break
        await asyncio.sleep(0.05)
    return StormReport(
        deliveries=len(deliveries),
        answers=dict(answers),
        orders=orders,
        rows=rows,
        distinct=distinct,
        seconds=time.perf_counter() - started,
    )
