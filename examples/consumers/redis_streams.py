"""An idempotent Redis Streams consumer (a consumer group): each entry's effect happens once.

    .venv/bin/python examples/consumers/redis_streams.py --stream outbox.order --dsn postgresql://...

The dedupe key is the entry's ``message-id`` field (the outbox id), not the Redis entry id: a
relay that republishes after a crash appends a new entry with the same ``message-id``. The claim
and the handler's row commit together; ``XACK`` follows the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from psycopg import AsyncConnection
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from pgonce.consumers import IdempotentConsumer


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--stream", default="outbox.order")
    parser.add_argument("--group", default="shipping")
    parser.add_argument("--stop-after", type=int, default=0, help="exit after N entries")
    args = parser.parse_args()

    db = await AsyncConnection.connect(args.dsn, autocommit=True)
    await db.execute(
        "CREATE TABLE IF NOT EXISTS shipments (order_id text PRIMARY KEY, message_id text)"
    )
    consumer = IdempotentConsumer("shipping")
    redis = Redis.from_url(args.url)
    try:
        await redis.xgroup_create(args.stream, args.group, id="0", mkstream=True)
    except redis_errors.ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise
    seen = 0
    while not args.stop_after or seen < args.stop_after:
        # "0" first re-reads entries this consumer took but never acknowledged (a crash); ">" then
        # takes new ones.
        batches = await redis.xreadgroup(args.group, "example", {args.stream: "0"}, count=10)
        if not batches or not batches[0][1]:
            batches = await redis.xreadgroup(
                args.group, "example", {args.stream: ">"}, count=10, block=5000
            )
        for _stream, entries in batches or []:
            for entry_id, fields in entries:
                message_id = fields[b"message-id"].decode()
                event = json.loads(fields[b"payload"])

                async def ship(
                    conn: AsyncConnection[Any], event: Any = event, mid: str = message_id
                ) -> None:
                    await conn.execute(
                        "INSERT INTO shipments (order_id, message_id) VALUES (%s, %s)",
                        (str(event["order_id"]), mid),
                    )

                outcome = await consumer.handle(db, message_id, fields[b"payload"], ship)
                if outcome.acknowledge:
                    await redis.xack(args.stream, args.group, entry_id)
                print(f"{message_id}: {outcome.value}", flush=True)
                seen += 1
    await redis.aclose()
    await db.close()


if __name__ == "__main__":
    asyncio.run(main())
