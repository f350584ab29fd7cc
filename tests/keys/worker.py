"""A separate process for the key store's concurrency and crash tests.

``python -m tests.keys.worker storm DSN KEY N``: N concurrent deliveries of one key over a small
pool; prints one JSON line per delivery outcome.

``python -m tests.keys.worker crash DSN KEY STEP``: claims KEY, writes, and after STEP ("claimed",
"written", "completed") prints the step and blocks until killed, its transaction open.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from pgonce import AsyncKeyStore, KeyStore, Response, Won, fingerprint

FP = fingerprint("the one request")


async def deliver(pool: AsyncConnectionPool[Any], store: AsyncKeyStore, key: str) -> dict[str, Any]:
    """One delivery, retried while in flight, like a client that honours Retry-After."""
    for _ in range(1000):
        async with pool.connection() as conn, store.once(conn, "storm", key, FP, commit=True) as op:
            if op.won:
                cur = await conn.execute(
                    "INSERT INTO effects (key) VALUES (%s) RETURNING id", (key,)
                )
                row = await cur.fetchone()
                assert row is not None
                op.respond(Response(201, (("x-effect", str(row[0])),), f"effect {row[0]}".encode()))
        if not op.in_flight:
            assert op.response is not None
            return {"won": op.won, "body": op.response.body.decode()}
        await asyncio.sleep(0.005)
    raise AssertionError("never resolved")


async def storm(dsn: str, key: str, n: int, pool_size: int) -> None:
    store = AsyncKeyStore(wait=timedelta(milliseconds=200))
    async with AsyncConnectionPool(dsn, min_size=pool_size, max_size=pool_size, open=False) as pool:
        results = await asyncio.gather(*(deliver(pool, store, key) for _ in range(n)))
    for result in results:
        print(json.dumps(result))


def crash(dsn: str, key: str, step: str) -> None:
    store = KeyStore()
    conn = psycopg.connect(dsn)
    claim = store.claim(conn, "crash", key, FP)
    print("claimed", flush=True)
    if step == "claimed":
        sys.stdin.read()
    conn.execute("INSERT INTO effects (key) VALUES (%s)", (key,))
    print("written", flush=True)
    if step == "written":
        sys.stdin.read()
    assert isinstance(claim, Won)
    store.complete(conn, claim, Response(201, (), b"done"))
    print("completed", flush=True)
    sys.stdin.read()  # killed before COMMIT


if __name__ == "__main__":
    command, dsn, key, *rest = sys.argv[1:]
    if command == "storm":
        asyncio.run(storm(dsn, key, int(rest[0]), int(rest[1])))
    else:
        crash(dsn, key, rest[0])
