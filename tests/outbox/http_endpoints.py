"""What the webhook publisher's tests share: a loopback endpoint's server, the reading of one
request from a connection, and an endpoint that answers 204 to every request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The body of the next request on ``reader`` (its head read and dropped; no
    Content-Length: an empty body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ),
        0,
    )
    return await reader.readexactly(length)


@contextlib.asynccontextmanager
async def serving(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    writers: Iterable[asyncio.StreamWriter] = (),
) -> AsyncIterator[int]:
    """A server on 127.0.0.1 handing its connections to ``handle``; yields its port. The
    connections in ``writers`` are closed when the block ends, after the server."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()


@contextlib.asynccontextmanager
async def answering() -> AsyncIterator[tuple[int, list[bytes]]]:
    """An endpoint answering 204 to every request; yields its port and the bodies it took."""
    bodies: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                bodies.append(await read_request(reader))
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        writer.close()

    async with serving(handle) as port:
        yield port, bodies
