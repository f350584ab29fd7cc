"""A TCP proxy the suite owns: a loopback port in front of PostgreSQL's Unix socket or a broker's
TCP port, that can cut every open connection at any moment (mid-transaction, mid-batch) and refuse
new ones for a while.

It runs its own event loop in a thread of its own, so that it keeps forwarding while the suite's
loop is busy (sending load, restarting a server). Cutting aborts both sockets (a TCP reset to the
client side), which is what a crashed load balancer or a network partition looks like to pgonce.
It can also hold back what the target sends (a stalled network: requests arrive, answers do not).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """Forward ``127.0.0.1:port`` to ``unix_path`` or to ``(host, port)``."""

    def __init__(self, *, unix_path: str | None = None, tcp: tuple[str, int] | None = None) -> None:
        if (unix_path is None) == (tcp is None):
            raise ValueError("give the proxy one target")
        self.unix_path = unix_path
        self.tcp = tcp
        self.port = free_port()
        #: Connections accepted, and cuts made (each cut may close several connections).
        self.accepted = 0
        self.cut_connections = 0
        self._refusing = False
        # Set while answers flow; cleared by hold(True), which makes target-to-client pipes wait.
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="faults-proxy")
        self._thread.daemon = True

    def __enter__(self) -> Proxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()

    def cut(self) -> int:
        """Abort every open connection now; return how many were cut."""
        return self._call(self._cut())

    def refuse(self, refusing: bool) -> None:
        """While refusing, new connections are accepted and reset at once (the target is down)."""
        self._refusing = refusing
        if refusing:
            self.cut()

    def hold(self, holding: bool) -> None:
        """While holding, what the target sends is kept back (the client's requests still go)."""

        def switch() -> None:
            assert self._flowing is not None
            if holding:
                self._flowing.clear()
            else:
                self._flowing.set()

        self._loop.call_soon_threadsafe(switch)

    async def _cut(self) -> int:
        writers = list(self._writers)
        self._writers.clear()
        for writer in writers:
            writer.transport.abort()
        # Two writers (client side, target side) make one connection.
        cut = len(writers) // 2
        self.cut_connections += cut
        return cut

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refusing:
            writer.transport.abort()
            return
        try:
            if self.unix_path is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self.unix_path)
            else:
                assert self.tcp is not None
                up_reader, up_writer = await asyncio.open_connection(*self.tcp)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer),
            self._pipe(up_reader, writer, answers=True),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, answers: bool = False
    ) -> None:
        try:
            while data := await reader.read(65536):
                if answers and self._flowing is not None:
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()
