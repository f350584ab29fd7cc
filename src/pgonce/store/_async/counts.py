"""How many rows a statement changed, wherever the caller's connection is.

In psycopg's pipeline mode a statement's result, and so its row count, arrives when the pipeline
syncs: until then ``cursor.rowcount`` is -1. A store method that answers with the count (whether
a response was stored, how many rows were marked) syncs the pipeline first, or it would answer
"nothing changed" for a change that happened.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, AsyncCursor


async def changed(conn: AsyncConnection[Any], cur: AsyncCursor[Any]) -> int:
    """The rows ``cur``'s last statement changed; in the caller's pipeline, after a sync."""
    if cur.rowcount < 0 and conn.pgconn.pipeline_status:
        async with conn.pipeline() as pipeline:
            await pipeline.sync()
    return cur.rowcount
