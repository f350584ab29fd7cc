"""A registered two-phase operation for the completer's tests: records a payment, answers 201."""

from __future__ import annotations

from typing import Any

import psycopg

from pgonce import Response
from pgonce.phases import AsyncPhasedOperation


async def pay(op: AsyncPhasedOperation[Any]) -> Response:
    async def create(conn: psycopg.AsyncConnection[Any]) -> str:
        await conn.execute("INSERT INTO payments (key) VALUES (%s)", (op.key,))
        return op.key

    await op.phase("create", create)
    return Response(201, body=f"paid {op.args['amount']}".encode())


async def broken(op: AsyncPhasedOperation[Any]) -> Response:
    """Charges, then fails every time: the completer retires it."""
    await op.call("charge", _charged)
    raise RuntimeError("the ledger is down")


async def _charged(idempotency_key: str) -> dict[str, str]:
    return {"id": "ch_" + idempotency_key[-6:]}
