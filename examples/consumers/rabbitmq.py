"""An idempotent RabbitMQ consumer: each message's effect happens once, however often it arrives.

    .venv/bin/python examples/consumers/rabbitmq.py --queue order --dsn postgresql://...

The handler records a shipment per ``order.created`` event. The claim of the message id and the
shipment row commit together; the message is acknowledged only after that commit. Kill the
consumer at any point and start it again: RabbitMQ redelivers what was not acknowledged, and a
redelivery of a committed message is a duplicate that only gets its acknowledgement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import aio_pika
from psycopg import AsyncConnection

from pgonce.consumers import IdempotentConsumer, Outcome


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--queue", default="order")
    parser.add_argument("--stop-after", type=int, default=0, help="exit after N messages")
    args = parser.parse_args()

    db = await AsyncConnection.connect(args.dsn, autocommit=True)
    await db.execute(
        "CREATE TABLE IF NOT EXISTS shipments (order_id text PRIMARY KEY, message_id text)"
    )
    consumer = IdempotentConsumer("shipping")
    broker = await aio_pika.connect(args.url)
    channel = await broker.channel()
    # One unacknowledged message at a time: acknowledgement follows each commit.
    await channel.set_qos(prefetch_count=1)
    queue = await channel.declare_queue(args.queue, passive=True)
    seen = 0
    async with queue.iterator() as messages:
        async for message in messages:
            event = json.loads(message.body)
            message_id = str(message.message_id)

            async def ship(
                conn: AsyncConnection[Any], event: Any = event, mid: str = message_id
            ) -> None:
                await conn.execute(
                    "INSERT INTO shipments (order_id, message_id) VALUES (%s, %s)",
                    (str(event["order_id"]), mid),
                )

            try:
                outcome = await consumer.handle(db, message_id, message.body, ship)
            except Exception:
                # Nothing committed: let the broker redeliver (or dead-letter) it.
                await message.nack(requeue=True)
                raise
            if outcome.acknowledge:
                await message.ack()
            else:
                await message.nack(requeue=True)
            print(f"{message.message_id}: {outcome.value}", flush=True)
            seen += outcome is not Outcome.IN_FLIGHT
            if args.stop_after and seen >= args.stop_after:
                break
    await broker.close()
    await db.close()


if __name__ == "__main__":
    asyncio.run(main())
