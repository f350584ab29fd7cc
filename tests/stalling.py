"""A PostgreSQL server that freezes at a chosen moment, for the stalled-network tests.

:class:`FreezingProxy` forwards to the test server, by TCP or its Unix socket (through the
suite's own proxy), until a client sends a statement holding ``marker``: from then on no answer
comes back on any connection, old or new (a host that froze, a half-dead load balancer). Requests
still arrive, so the server's own statement timeout fires, but its error never reaches the client
either. ``frozen`` is set at that moment, for a test to wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from faults.proxy import Proxy


def server_of(dsn: str) -> tuple[str | None, tuple[str, int] | None]:
    """The proxy target of ``dsn``'s server: its Unix socket file, or else its TCP address."""
    params = conninfo_to_dict(dsn)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}", None
    return None, (host, port)


def proxy_to(dsn: str) -> Proxy:
    """A :class:`Proxy` in front of the server of ``dsn``, reached by TCP or a Unix socket."""
    unix_path, tcp = server_of(dsn)
    return Proxy(unix_path=unix_path, tcp=tcp)


def through(proxy: Proxy, dsn: str) -> str:
    """``dsn`` through ``proxy``."""
    return make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))


class FreezingProxy(Proxy):
    def __init__(
        self,
        marker: bytes | None,
        *,
        unix_path: str | None = None,
        tcp: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(unix_path=unix_path, tcp=tcp)
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
    """A :class:`FreezingProxy` in front of the server of ``dsn``."""
    unix_path, tcp = server_of(dsn)
    return FreezingProxy(marker, unix_path=unix_path, tcp=tcp)
