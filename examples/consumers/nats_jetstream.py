"""An idempotent NATS JetStream consumer: each message's effect happens once.

(Not named nats.py: a script of that name would shadow the nats package it imports.)

    .venv/bin/python examples/consumers/nats_jetstream.py --stream ORDERS --subject 'outbox.order' \
        --dsn postgresql://...

JetStream already drops a republished message with the same ``Nats-Msg-Id`` inside its duplicate
window; a consumer still sees redeliveries (an ack that was lost, a consumer that restarted). The
claim of the message id and the handler's row commit together; the message is acknowledged only
after that commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import nats
from psycopg import AsyncConnection

from pgonce.consumers import IdempotentConsumer


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--url", default="nats://127.0.0.1:4222")
    parser.add_argument("--stream", default="ORDERS")
    parser.add_argument("--subject", default="outbox.order")
    parser.add_argument("--durable", default="shipping")
    parser.add_argument("--stop-after", type=int, default=0, help="exit after N messages")
    args = parser.parse_args()

    db = await AsyncConnection.connect(args.dsn, autocommit=True)
    await db.execute(
        "CREATE TABLE IF NOT EXISTS shipments (order_id text PRIMARY KEY, message_id text)"
    )
    consumer = IdempotentConsumer("shipping")
    client = await nats.connect(args.url)
    js = client.jetstream()
    subscription = await js.pull_subscribe(args.subject, args.durable, stream=args.stream)
    seen = 0
    while not args.stop_after or seen < args.stop_after:
        try:
            messages = await subscription.fetch(10, timeout=5)
        except nats.errors.TimeoutError:
            continue
        for message in messages:
            message_id = (message.headers or {}).get("Nats-Msg-Id", "")
            event = json.loads(message.data)

            async def ship(
                conn: AsyncConnection[Any], event: Any = event, mid: str = message_id
            ) -> None:
                await conn.execute(
                    "INSERT INTO shipments (order_id, message_id) VALUES (%s, %s)",
                    (str(event["order_id"]), mid),
                )

            outcome = await consumer.handle(db, message_id, message.data, ship)
            if outcome.acknowledge:
                await message.ack()
            else:
                await message.nak(delay=1)
            print(f"{message_id}: {outcome.value}", flush=True)
            seen += 1
    await client.close()
    await db.close()


if __name__ == "__main__":
    asyncio.run(main())
