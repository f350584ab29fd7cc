"""A relay in a process of its own, for the concurrency and kill -9 tests.

``python -m tests.outbox.relay_process DSN BROKER URL DEST [--hang-after N] [--wait-go]``
publishes until the outbox has no pending row. With ``--hang-after N`` it stops after the N-th
batch was acknowledged by the broker but before the batch is marked: it prints the acknowledged
ids as a JSON line and waits forever, which is the moment the test kills it with SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import Publisher, PublishResult
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay


class HangAfter:
    """Passes batches to ``inner``; after the ``after``-th, reports the acks and never returns."""

    def __init__(self, inner: Publisher, after: int) -> None:
        self.name = inner.name
        self.inner = inner
        self.after = after
        self.batches = 0

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        result = await self.inner.publish(batch)
        self.batches += 1
        if self.batches >= self.after:
            print(json.dumps(sorted(result.acked)), flush=True)
            await asyncio.Event().wait()
        return result

    async def close(self) -> None:
        await self.inner.close()


def publisher(broker: str, url: str, dest: str) -> Publisher:
    if broker == "rabbitmq":
        return RabbitMQPublisher(url, routing=lambda m: dest)
    if broker == "nats":
        return NatsPublisher(url, routing=lambda m: f"{dest}.{m.aggregatetype}")
    if broker == "redis":
        return RedisStreamsPublisher(url, routing=lambda m: dest)
    raise SystemExit(f"unknown broker {broker}")


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("broker", choices=["rabbitmq", "nats", "redis"])
    parser.add_argument("url")
    parser.add_argument("dest")
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--wait-go", action="store_true", help="start on a line on stdin")
    args = parser.parse_args(argv)
    chosen = publisher(args.broker, args.url, args.dest)
    if args.hang_after:
        chosen = HangAfter(chosen, args.hang_after)
    relay = Relay(args.dsn, chosen, batch_size=args.batch_size)
    conn = await relay.connect(args.dsn)
    published = 0
    try:
        print("ready", flush=True)
        if args.wait_go:
            await asyncio.to_thread(sys.stdin.readline)
        while True:
            report = await relay.run_once(conn)
            published += report.published
            if report.claimed:
                continue
            # Nothing claimable: done if nothing is pending, else another relay holds the rest.
            cur = await conn.execute(
                "SELECT count(*) FROM pgonce.outbox WHERE published_at IS NULL"
            )
            row = await cur.fetchone()
            if row is None or row[0] == 0:
                break
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
        await chosen.close()
    print(json.dumps({"published": published}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
