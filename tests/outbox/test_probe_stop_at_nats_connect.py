"""A relay asked to stop as its batch's connection to NATS is made stops at once, too.

nats-py makes its TCP connection inside asyncio.wait_for(). On Python 3.11, wait_for() returns the
result of a connect that completed while its caller was being cancelled, and the cancel is lost.
The NATS publisher used to await nats-py's connect in the batch itself: the batch then went on to
wait for the server's INFO, and a stop that landed at that instant waited for the publisher's
connect timeout (5 s) against a broker that accepts and does not answer. The connect now runs in
a task of its own that the batches await through asyncio.wait(), as the RabbitMQ publisher's
does, and a cancelled batch returns at once ("connecting").

Under load the moment is hit by chance (test_probe_stop_while_connecting.py's NATS case stopped
at the broker's accept, which comes just before it); here the stop is made at that instant, every
time: set as the batch's TCP connect returns, the relay's cancel reaches the batch a loop turn or
two later, before the batch resumes from wait_for().
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from pgonce.publishers.nats import NatsPublisher
from pgonce.relay import STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.stops import Run, silent_server

#: Below the NATS publisher's 5 s connect timeout, which the stop waits for.
BOUND = STOP_WAIT.total_seconds() + 1


async def test_a_stop_as_the_batch_connects_to_nats_ends_the_relay_at_once(
    direct_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(direct_dsn) as conn:
        enqueue(conn, "order", "1", "created", {"n": 1})
    # The first connection, the check at the start, is closed at once: the loops start without
    # its 5 s. The second is the batch's, held without an answer.
    async with silent_server(refused=1) as silent:
        relay = Relay(
            direct_dsn,
            NatsPublisher(f"nats://127.0.0.1:{silent.port}"),
            listen=False,
            concurrency=1,
        )
        open_connection = asyncio.open_connection
        connects: list[Any] = []
        run: Run

        async def connecting(*args: Any, **kwargs: Any) -> Any:
            opened = await open_connection(*args, **kwargs)
            if kwargs.get("port") == silent.port:
                connects.append(opened)
                if len(connects) == 2:
                    # SIGTERM as the batch's connection is made; the connect returns two loop
                    # turns later, as the relay's cancel reaches the batch.
                    run.stop.set()
                    for _ in range(2):
                        await asyncio.sleep(0)
            return opened

        monkeypatch.setattr(asyncio, "open_connection", connecting)
        run = Run(relay)
        try:
            await run.stop.wait()
            await run.stop_within(BOUND, "the relay did not stop as its batch connected")
        finally:
            if not run.task.done():
                run.task.cancel()
                await asyncio.wait({run.task})
