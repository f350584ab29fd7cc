"""The --count-url read: a kept-alive connection the count endpoint closed as the next read was
sent stopped the whole run ("cannot read the count"), where every other request of the kit is
sent again once; and a proxy's 502 for the count was not said to be a server failure."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from pgonce.conformance.effects import CountUnreadable, UrlEffects
from pgonce.conformance.runner import client
from tests.conformance.test_probe_server_failures import answering
from tests.loopback import loopback, read_headers


def drops_kept_alive(conn: socket.socket) -> None:
    """Answers the first request of a connection and keeps it open; a second request on it is
    read and the connection closed unanswered (the idle timeout that fired just then)."""
    with conn:
        try:
            if read_headers(conn) is None:
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n7")
            read_headers(conn)
        except OSError:
            pass


@pytest.fixture
def dropping() -> Iterator[str]:
    with loopback(drops_kept_alive) as address:
        yield f"http://{address}/count"


@pytest.fixture
def proxy() -> Iterator[str]:
    with loopback(answering(502)) as address:
        yield f"http://{address}/count?token=hunter2"


async def counts(url: str, reads: int) -> list[int]:
    async with client() as session:
        effects = UrlEffects(session, url)
        return [await effects.count() for _ in range(reads)]


def test_a_kept_alive_connection_closed_under_a_count_read_is_sent_again(dropping: str) -> None:
    assert asyncio.run(counts(dropping, 3)) == [7, 7, 7]


def test_a_count_endpoint_answering_502_is_a_server_failure(proxy: str) -> None:
    with pytest.raises(CountUnreadable) as refused:
        asyncio.run(counts(proxy, 1))
    said = str(refused.value)
    assert said.endswith("/count?token=*** answered 502, a server failure, not 200"), said
