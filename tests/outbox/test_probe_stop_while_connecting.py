"""A relay asked to stop while its loops wait for a database connection stops at once. A server
that accepts connections and does not answer (a stalled host, a pooler whose pool is full) used to
hold SIGTERM for as long as libpq's connect timeout, two minutes and more; no batch is in progress
then, so nothing is lost by giving up the connection."""

from __future__ import annotations

import asyncio

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import LOOPS_PER_BATCH_IN_FLIGHT, Relay
from tests.outbox.conftest import wait_until


async def test_stop_ends_a_relay_whose_database_does_not_answer() -> None:
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = Relay(
        f"postgresql://postgres@127.0.0.1:{port}/test",
        RedisStreamsPublisher("redis://127.0.0.1:9/0"),
        listen=False,
        concurrency=1,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: len(held) >= LOOPS_PER_BATCH_IN_FLIGHT)
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=10)
        assert running in done, "the relay did not stop while connecting"
        running.result()
    finally:
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
