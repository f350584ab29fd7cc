"""A PostgreSQL server that freezes at a chosen moment, for the stalled-network tests.

:class:`FreezingProxy` forwards TCP to the test server (through the suite's own proxy) until a
client sends a statement holding ``marker``: from then on no answer comes back on any connection,
old or new (a host that froze, a half-dead load balancer). Requests still arrive, so the server's
own statement timeout fires, but its error never reaches the client either. ``frozen`` is set at
that moment, for a test to wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from faults.proxy import Proxy


class FreezingProxy(Proxy):
    def __init__(self, marker: bytes | None, *, tcp: tuple[str, int]) -> None:
        super().__init__(tcp=tcp)
        self.marker = marker
        self.frozen = threading.Event()

    def __enter__(self) -> FreezingProxy:
        super().__enter__()
        return self

    def freeze(self) -> None:
        self.hold(True)
        self.frozen.set()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, answers: bool = False
    ) -> None:
        if answers:
            await super()._pipe(reader, writer, answers=True)
            return
        try:
            while data := await reader.read(65536):
                if self.marker is not None and self.marker in data and self._flowing is not None:
                    # Before the statement goes: its answer, and every later one, is held.
                    self._flowing.clear()
                    self.frozen.set()
                writer.write(data)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()

    def dsn(self, dsn: str) -> str:
        """``dsn`` through this proxy, in clear text so that the marker can be seen."""
        return make_conninfo(
            dsn, host="127.0.0.1", port=str(self.port), sslmode="disable", gssencmode="disable"
        )


def freezing(dsn: str, marker: bytes | None) -> FreezingProxy:
    """A :class:`FreezingProxy` in front of the server of ``dsn`` (skips on a Unix socket)."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server is reached by a Unix socket; the proxy forwards TCP")
    return FreezingProxy(marker, tcp=(host, int(params.get("port") or 5432)))
