"""A consumer's handler that opens transactions of its own (savepoints in handle()'s transaction),
rolls one of them back and enqueues the next event: the savepoint's work alone is undone, the
rest commits once with the claim, and a redelivery is a duplicate. With ``prepare_threshold=0``
psycopg prepares every statement, and the savepoint's rollback makes it deallocate them all
(DEALLOCATE ALL) in the middle of the claim's transaction, pgonce's statements with them."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import AsyncOutboxStore
from pgonce.consumers import IdempotentConsumer, Outcome


class Refused(Exception):
    pass


@pytest.mark.parametrize("prepare_threshold", [0, 5, None])
async def test_a_handler_savepoint_rolled_back_leaves_the_rest_committed_once(
    dsn: str, prepare_threshold: int | None
) -> None:
    consumer = IdempotentConsumer("shipping")
    outbox = AsyncOutboxStore()
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, prepare_threshold=prepare_threshold
    ) as conn:
        await conn.execute("CREATE TABLE shipments (order_id int, note text)")

        async def ship(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("INSERT INTO shipments VALUES (42, 'label')")
            try:
                async with conn.transaction():
                    await conn.execute("INSERT INTO shipments VALUES (42, 'express')")
                    raise Refused
            except Refused:
                pass
            for _ in range(3):  # enough runs for psycopg to prepare its statements again
                await conn.execute("SELECT %s::int", (1,))
            async with conn.transaction():
                await outbox.enqueue(conn, "shipment", "42", "shipment.created", {"order": 42})

        outcomes = [await consumer.handle(conn, "m-1", b'{"order": 42}', ship) for _ in range(3)]
        assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.DUPLICATE]
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        cur = await conn.execute("SELECT note FROM shipments")
        assert await cur.fetchall() == [("label",)]
        cur = await conn.execute("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = '42'")
        assert await cur.fetchone() == (1,)
        cur = await conn.execute(
            "SELECT count(*) FROM pgonce.keys WHERE scope = 'shipping' AND completed_at IS NOT NULL"
        )
        assert await cur.fetchone() == (1,)
