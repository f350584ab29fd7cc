"""A connect to NATS cancelled once its TCP connection is made leaves no socket open behind it.

The publisher's close() -- a relay's stop -- cancels the connect in progress, and the connect
ends then, whenever the cancel lands. nats-py makes the
TCP connection and then waits for the server's INFO; cancelled there, ``nats.connect()`` left
its half-made client behind with the socket open, and the socket was only closed (with a
ResourceWarning) when the garbage collector found it. The publisher now builds the client itself
and closes it when its connect does not complete.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest

from pgonce.errors import BrokerUnavailable
from pgonce.publishers.nats import NatsPublisher
from tests.outbox.stops import silent_server

#: Loop turns the cancelled connect is given to end (it takes a handful).
TURNS = 50


@pytest.mark.parametrize(
    "turns",
    [
        # The cancel reaches nats-py's connect as wait_for() is about to return the TCP
        # connection: on Python 3.11 wait_for() loses it, and the connect went on waiting for
        # the server's INFO until its own timeout (5 s), which it raised with the socket open;
        # the publisher now cancels it again until it has ended.
        0,
        # The cancel reaches the wait for INFO, and ends the connect at once.
        10,
    ],
)
async def test_a_cancelled_connect_closes_its_socket(
    turns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with silent_server() as silent:
        publisher = NatsPublisher(f"nats://127.0.0.1:{silent.port}")
        open_connection = asyncio.open_connection
        writers: list[asyncio.StreamWriter] = []
        made = asyncio.Event()

        async def connecting(*args: Any, **kwargs: Any) -> Any:
            reader, writer = await open_connection(*args, **kwargs)
            writers.append(writer)
            made.set()
            return reader, writer

        monkeypatch.setattr(asyncio, "open_connection", connecting)
        gc.collect()  # what earlier tests of this process left for the collector, not counted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            before = asyncio.all_tasks()
            preparing = asyncio.create_task(publisher.prepare())
            await made.wait()
            for _ in range(turns):
                await asyncio.sleep(0)
            # A relay's stop: the connect in progress is cancelled.
            await publisher.close()
            # The cancelled connect ends, and the prepare() with it, within a few loop turns;
            # not when nats-py's own connect timeout (5 s) ends a connect whose cancel was lost.
            for _ in range(TURNS):
                lingering = [t for t in asyncio.all_tasks() - before if not t.done()]
                if not lingering:
                    break
                await asyncio.sleep(0)
            assert not lingering, lingering
            assert isinstance(preparing.exception(), BrokerUnavailable)
            (writer,) = writers
            assert writer.transport.is_closing(), "the cancelled connect left its socket open"
            del writer, writers[:]
            gc.collect()
        # This connect's socket only (its server's port): the collector may find another
        # test's garbage here too.
        leaked = [
            w
            for w in caught
            if issubclass(w.category, ResourceWarning) and f", {silent.port})" in str(w.message)
        ]
        assert not leaked, [str(w.message) for w in leaked]
