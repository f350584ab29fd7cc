"""How the kit sees effects: a number the application exposes, read before and after each check.

The contract is one number that grows by one for every time the work really happened (a payment
row, a handled event), read either

- from a read-only endpoint (``--count-url``): a ``GET`` answered 200 with the number as the body,
  as a JSON number, or as a JSON object with a single number in it (``{"count": 3}``); or
- from the application's database (``--count-sql`` with ``--dsn``): a query returning one row with
  one number, run in a read-only transaction that is rolled back.

A duplicate effect is then counted, not guessed from responses. The number must not move for any
other reason while the kit runs: point the kit at an instance nobody else is using.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

import psycopg
from psycopg import sql

from pgonce.core.urls import public
from pgonce.database import check_parsable
from pgonce.errors import ConfigError, UsageError

#: The longest one read of the count may take, in seconds (the kit's per-request bound).
COUNT_TIMEOUT = 10.0

#: How many times the count may still move before it is judged anyway (a count that never holds
#: still is an application doing other work: the check then judges the last value read).
SETTLE_ROUNDS = 20


class Effects(Protocol):
    """A source of the effect count."""

    #: Where the number comes from, for the evidence ("GET /count", "SQL query").
    description: str

    async def count(self) -> int: ...

    async def close(self) -> None: ...


class CountUnreadable(UsageError):
    """The effect count could not be read: the contract (--count-url, --count-sql) is not met."""


class UrlEffects:
    """The number a read-only endpoint answers (``--count-url``)."""

    def __init__(self, client: Any, url: str) -> None:
        self.client = client  # an httpx.AsyncClient, owned by the caller
        self.url = url
        self.description = f"GET {public(url)}"

    async def count(self) -> int:
        import httpx

        from pgonce.conformance.runner import (
            RateLimited,
            answered,
            failure,
            kept_limiting,
            patiently,
            request,
        )

        where = f"the count endpoint {public(self.url)}"
        try:
            # Sent again once if a kept-alive connection was closed under it, as every request,
            # and after its Retry-After while it answers 429 (a rate limiter in front of the
            # application counts the kit's requests, count reads and all).
            response = await patiently(lambda: request(self.client, "GET", self.url), where)
        except httpx.HTTPError as error:
            # The count endpoint down or not HTTP: the contract is not met, said as such.
            raise CountUnreadable(
                f"cannot read the count at {public(self.url)}: {failure(error)}"
            ) from None
        except RateLimited as error:
            raise CountUnreadable(limited(where, kept_limiting(error))) from None
        if response.status_code == 429:
            raise CountUnreadable(limited(where, "without a Retry-After"))
        if response.status_code != 200:
            raise CountUnreadable(
                answered(f"the count endpoint {public(self.url)}", response, "200")
            )
        return number_of(response.content, public(self.url))

    async def close(self) -> None:
        return None


def limited(where: str, how: str) -> str:
    """Why the count cannot be read: the endpoint stays rate limited."""
    return (
        f"{where} is rate limited: it answered 429 Too Many Requests {how}; the kit reads the "
        "count around every check: exempt it from the rate limiting, or run the kit where it "
        "is not rate limited"
    )


def number_of(body: bytes, where: str) -> int:
    """The count a count endpoint answered: ``3``, ``"3"`` as JSON, or ``{"count": 3}``."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and len(value) == 1:
        value = next(iter(value.values()))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CountUnreadable(
        f"the count endpoint {where} must answer one non-negative integer "
        '(3, or {"count": 3}); it answered something else'
    )


class SqlEffects:
    """The number a query returns (``--count-sql``), read in a rolled-back read-only transaction."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], query: str) -> None:
        self.conn = conn
        # The user's own query against their own database, run as given (read-only).
        self.query = sql.SQL(query)
        self.description = "the --count-sql query"

    @classmethod
    async def connect(cls, dsn: str, query: str) -> SqlEffects:
        try:
            # libpq's parse error quotes the connection string, password and all.
            check_parsable(dsn)
        except ConfigError as error:
            raise CountUnreadable(f"cannot connect to --dsn for --count-sql: {error}") from None
        try:
            conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=5)
            await conn.set_read_only(True)
        except psycopg.Error as error:
            raise CountUnreadable(f"cannot connect to --dsn for --count-sql: {error}") from None
        return cls(conn, query)

    async def count(self) -> int:
        try:
            async with self.conn.transaction(force_rollback=True):
                # A count read is a request like any other: bounded, so a query that hangs (a
                # lock, a huge table) fails the run instead of holding it past its budget.
                await self.conn.execute(
                    "SELECT set_config('statement_timeout', %s, true)",
                    (f"{int(COUNT_TIMEOUT * 1000)}ms",),
                )
                cur = await self.conn.execute(self.query)
                rows = await cur.fetchall()
        except psycopg.Error as error:
            raise CountUnreadable(f"the --count-sql query failed: {error}") from None
        if len(rows) != 1 or len(rows[0]) != 1:
            raise CountUnreadable("the --count-sql query must return one row with one column")
        value = rows[0][0]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CountUnreadable("the --count-sql query must return one non-negative integer")
        return value

    async def close(self) -> None:
        await self.conn.close()


async def settled_count(
    effects: Effects, *, reach: int, within: float, settle: float, poll: float = 0.05
) -> int:
    """The count once it reached ``reach`` (or ``within`` seconds passed), then held ``settle`` s.

    Effects of webhook deliveries happen after the acknowledgement (a worker handles the stored
    event), so a count read at once would miss them; and one extra effect arriving late is exactly
    what the kit looks for, so the count must also stop moving before it is judged.
    """
    deadline = time.monotonic() + within
    value = await effects.count()
    while value < reach and time.monotonic() < deadline:
        await asyncio.sleep(poll)
        value = await effects.count()
    for _ in range(SETTLE_ROUNDS if settle > 0 else 0):
        await asyncio.sleep(settle)
        again = await effects.count()
        if again == value:
            break
        value = again
    return value
