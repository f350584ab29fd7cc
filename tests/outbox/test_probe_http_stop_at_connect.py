"""A relay asked to stop while the webhook publisher's TCP connect waits for an endpoint that never
accepts (a host that drops SYNs: a firewall, a down host behind a routed address, a listener with
a full backlog) stops at once, and nothing is lost: the row stays unpublished, with no attempt
counted, and the next relay publishes it.

The connect used to be made inside publish(), where the relay counts the batch's rows as at the
broker and gives them the whole stop grace (10 s) to be answered; nothing of the batch had gone
out. The connect to the endpoint's origin is now the publisher's prepare(), which the relay
cancels at once at a stop ("connecting").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import psycopg

from pgonce.publishers.http import HttpPublisher
from pgonce.relay import STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.stops import Run

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

#: Well below the stop grace (10 s) that the stop used to wait out.
BOUND = STOP_WAIT.total_seconds() + 1.5


@contextlib.contextmanager
def full_backlog() -> Iterator[int]:
    """A loopback port whose listener never accepts and whose accept queue is full: the kernel
    drops every further SYN, and a connect to it waits (retrying) until its own timeout."""
    listener = socket.socket()
    filler = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        filler.connect(("127.0.0.1", port))  # the one connection the queue holds
        yield port
    finally:
        filler.close()
        listener.close()


def connecting_to(port: int) -> bool:
    """Whether a socket of this host waits in SYN_SENT for ``port`` on the loopback."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "02" and int(fields[2].split(":")[1], 16) == port:
                    return True
    return False


@contextlib.asynccontextmanager
async def answering() -> AsyncIterator[tuple[int, list[bytes]]]:
    """An endpoint answering 204 to every request; yields its port and the bodies it took."""
    bodies: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                bodies.append(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], bodies
    finally:
        server.close()


def row_state(dsn: str, row_id: int) -> tuple[bool, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT published_at IS NOT NULL, attempts FROM pgonce.outbox WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


async def test_a_stop_while_the_webhook_connect_waits_ends_the_relay_at_once(
    direct_dsn: str,
) -> None:
    with psycopg.connect(direct_dsn) as conn:
        row_id = enqueue(conn, "order", "1", "created", {"n": 1})
    with full_backlog() as port:
        publisher = HttpPublisher(
            secret=SECRET, url=f"http://127.0.0.1:{port}/hook", timeout=timedelta(seconds=30)
        )
        relay = Relay(direct_dsn, publisher, listen=False, concurrency=1)
        run = Run(relay)
        try:
            # The batch's connect is made: its SYN is in the kernel, unanswered.
            while not connecting_to(port):
                assert not run.task.done(), run.task
                await asyncio.sleep(0.01)
            await run.stop_within(BOUND, "the relay waited for the webhook's connect at the stop")
        finally:
            if not run.task.done():
                run.task.cancel()
                await asyncio.wait({run.task})
            await publisher.close()
    assert row_state(direct_dsn, row_id) == (False, 0)
    async with answering() as (port, bodies):
        publisher = HttpPublisher(secret=SECRET, url=f"http://127.0.0.1:{port}/hook")
        try:
            report = await Relay(direct_dsn, publisher, listen=False).drain()
        finally:
            await publisher.close()
    assert report.published == 1, report
    assert len(bodies) == 1
    assert row_state(direct_dsn, row_id) == (True, 0)


async def test_an_endpoint_refusing_the_connect_before_a_batch_refuses_its_rows(
    direct_dsn: str,
) -> None:
    """The connect made before the batch stands for its rows' attempt: a refused one refuses
    them (counted against the retry policy, as a refused connect inside the request was), and
    the endpoint is not connected to again for each row."""
    with psycopg.connect(direct_dsn) as setup:
        ids = [enqueue(setup, "order", str(n), "created", {"n": n}) for n in range(3)]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = int(closed.getsockname()[1])  # bound, not listening: the connect is refused
        publisher = HttpPublisher(secret=SECRET, url=f"http://127.0.0.1:{port}/hook")
        relay = Relay(direct_dsn, publisher, listen=False)
        conn = await relay.connect(direct_dsn)
        try:
            report = await relay.run_once(conn)
        finally:
            await conn.close()
            await publisher.close()
    assert (report.claimed, report.published, report.refused) == (3, 0, 3), report
    assert [row_state(direct_dsn, row_id) for row_id in ids] == [(False, 1)] * 3
    assert relay.stats.failures == {"unreachable": 3}, relay.stats
