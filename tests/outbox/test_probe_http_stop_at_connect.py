"""A relay asked to stop while the webhook publisher's TCP connect waits for an endpoint that never
accepts (a host that drops SYNs: a firewall, a down host behind a routed address, a listener with
a full backlog) stops at once, and nothing is lost: the row stays unpublished, with no attempt
counted, and the next relay publishes it.

The connect used to be made inside publish(), where the relay counts the batch's rows as at the
broker and gives them the whole stop grace (10 s) to be answered; nothing of the batch had gone
out. With a fixed url, the connect to the endpoint's origin is now the publisher's prepare(), which
the relay cancels at once at a stop ("connecting"); with a routing function it stays inside
publish(), and the batch is "connecting" until the publisher says a request's first bytes go
out.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from pgonce.publishers.http import DEFAULT_TIMEOUT, HttpPublisher
from pgonce.relay import STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.http_endpoints import answering
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


def row_state(dsn: str, row_id: int) -> tuple[bool, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT published_at IS NOT NULL, attempts FROM pgonce.outbox WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


def publisher_to(url: str, how: str, *, timeout: timedelta = DEFAULT_TIMEOUT) -> HttpPublisher:
    """A webhook publisher sending to ``url``, given as its fixed url or by a routing function."""
    if how == "url":
        return HttpPublisher(secret=SECRET, url=url, timeout=timeout)
    return HttpPublisher(secret=SECRET, routing=lambda _message: url, timeout=timeout)


@pytest.mark.parametrize("how", ["url", "routing"])
async def test_a_stop_while_the_webhook_connect_waits_ends_the_relay_at_once(
    direct_dsn: str, how: str
) -> None:
    """With a routing function the connect is made inside publish(), per row: the publisher says
    when a request's first bytes go out, and until then the batch is only connecting."""
    with psycopg.connect(direct_dsn) as conn:
        row_id = enqueue(conn, "order", "1", "created", {"n": 1})
    with full_backlog() as port:
        publisher = publisher_to(
            f"http://127.0.0.1:{port}/hook", how, timeout=timedelta(seconds=60)
        )
        relay = Relay(direct_dsn, publisher, listen=False, concurrency=1)
        # Far above the bound: a stop that counts the batch as at the endpoint waits it out.
        relay.stop_grace = timedelta(seconds=30)
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
        publisher = publisher_to(f"http://127.0.0.1:{port}/hook", how)
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
