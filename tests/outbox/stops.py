"""What the tests of a relay's stop share: a loopback server that accepts connections and never
answers (a stalled host, a pooler whose pool is full, a half-dead load balancer), and a relay run
that is stopped and must end within a bound, cancelled on the way out if it did not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from pgonce.publishers.base import Publisher
from pgonce.relay import Relay, RelayStats


@dataclass
class Silent:
    """The connections a silent server holds; ``port`` is where it listens."""

    port: int = 0
    held: list[asyncio.StreamWriter] = field(default_factory=list)
    #: How many connections, the first ones, are closed at once instead of held.
    refused: int = 0
    accepted: int = 0

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.accepted <= self.refused:
            writer.close()
            return
        self.held.append(writer)  # accepted, never answered


@contextlib.asynccontextmanager
async def listening(
    accept: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    writers: list[asyncio.StreamWriter],
) -> AsyncIterator[int]:
    """A server on 127.0.0.1 handing its connections to ``accept``; yields its port. The
    connections in ``writers`` are closed when the block ends, and the server with them."""
    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def silent_server(refused: int = 0) -> AsyncIterator[Silent]:
    """A :class:`Silent` server, its connections closed when the block ends."""
    silent = Silent(refused=refused)
    async with listening(silent.accept, silent.held) as silent.port:
        yield silent


class Run:
    """A relay's run, and the event that stops it."""

    def __init__(self, relay: Relay) -> None:
        self.stop = asyncio.Event()
        self.task: asyncio.Task[RelayStats] = asyncio.create_task(relay.run(self.stop))

    async def stop_within(self, bound: float, what: str) -> None:
        """Stop the run and hold that it ends, without an error, within ``bound`` seconds;
        ``what`` is the failure's message."""
        loop = asyncio.get_running_loop()
        self.stop.set()
        stopped_at = loop.time()
        done, _ = await asyncio.wait({self.task}, timeout=bound)
        assert self.task in done, what
        self.task.result()
        assert loop.time() - stopped_at < bound, what


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[Run]:
    """The relay's run for the block; one still going at its end is cancelled, so that a failed
    test leaves no relay behind."""
    run = Run(relay)
    try:
        yield run
    finally:
        if not run.task.done():
            run.task.cancel()
            await asyncio.wait({run.task})


async def drain_with(dsn: str, publisher: Publisher) -> None:
    """Publish every pending row through ``publisher``, closed after."""
    try:
        await Relay(dsn, publisher, listen=False).drain()
    finally:
        await publisher.close()
