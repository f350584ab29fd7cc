"""A webhook endpoint that answers 2xx at once and then sends its body slowly, or without end.

Only the status decides; the body is read (and dropped) so that the connection can be used again.
A body that trickled in held the row's acknowledgement, and the rows of its aggregate behind it,
for a whole request timeout more (15 s by default): a hundred events of one aggregate took 25
minutes, and a stop meanwhile cut a batch whose rows the endpoint had taken, to be sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import timedelta

from pgonce.publishers.http import MAX_DISCARD_SECONDS, HttpPublisher
from tests.outbox.conftest import outbox_rows
from tests.outbox.http_endpoints import read_request, serving

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@contextlib.asynccontextmanager
async def endpoint(body: str) -> AsyncIterator[int]:
    """A port whose endpoint answers 200 at once, then ``body``: "trickle" (a byte every 50 ms
    of a long body) or "endless" (chunks without end, as fast as they are read)."""

    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await read_request(reader)
                if body == "trickle":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                    while True:
                        writer.write(b"x")
                        await writer.drain()
                        await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                while True:
                    writer.write(b"4000\r\n" + b"x" * 0x4000 + b"\r\n")
                    await writer.drain()
        writer.close()

    async with serving(handle, writers) as port:
        yield port


async def test_a_body_that_trickles_does_not_hold_the_rows_acknowledgement() -> None:
    timeout = timedelta(seconds=4)
    async with endpoint("trickle") as port:
        publisher = HttpPublisher(
            secret=SECRET, url=f"http://127.0.0.1:{port}/hooks", timeout=timeout
        )
        try:
            started = time.monotonic()
            result = await publisher.publish(outbox_rows(3, one_aggregate=True))
            took = time.monotonic() - started
        finally:
            await publisher.close()
    assert result.acked == {1, 2, 3}
    # Each row's body is read for at most MAX_DISCARD_SECONDS; it was the whole timeout.
    assert took < 3 * (MAX_DISCARD_SECONDS + 0.5) < 3 * timeout.total_seconds()


async def test_a_body_without_end_is_cut_and_the_next_row_goes() -> None:
    async with endpoint("endless") as port:
        publisher = HttpPublisher(
            secret=SECRET, url=f"http://127.0.0.1:{port}/hooks", timeout=timedelta(seconds=4)
        )
        try:
            started = time.monotonic()
            result = await publisher.publish(outbox_rows(3, one_aggregate=True))
            took = time.monotonic() - started
        finally:
            await publisher.close()
    assert result.acked == {1, 2, 3}
    assert took < 3 * MAX_DISCARD_SECONDS
