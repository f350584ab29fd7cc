"""The pooler check is asked once per server address, and an address behind PgBouncer is still
found to be one: no connection to it, the first or a later one, prepares statements."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce import database
from pgonce.database import own_prepare_threshold, reaches_server_directly


@pytest.fixture
def pooled_dsn(direct_dsn: str, pgbouncer_server_dsn: str) -> str:
    """The test's database through the suite's PgBouncer."""
    return make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The port of the address each ``SHOW port`` goes to, on an empty record of answers."""
    monkeypatch.setattr(database, "_PORT_SHOWN", {})
    monkeypatch.delenv("PGONCE_POOLER", raising=False)
    ports: list[int] = []
    execute, execute_async = psycopg.Cursor.execute, psycopg.AsyncCursor.execute

    def counting(cur: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "SHOW port":
            ports.append(cur.connection.info.port)
        return execute(cur, query, *args, **kwargs)

    async def counting_async(
        cur: psycopg.AsyncCursor[Any], query: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if query == "SHOW port":
            ports.append(cur.connection.info.port)
        return await execute_async(cur, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counting)
    monkeypatch.setattr(psycopg.AsyncCursor, "execute", counting_async)
    return ports


def test_a_pooled_address_is_asked_once_and_every_connection_to_it_is_pooled(
    direct_dsn: str, pooled_dsn: str, sent: list[int]
) -> None:
    answers = []
    for dsn in (pooled_dsn, pooled_dsn, direct_dsn, direct_dsn):
        with psycopg.connect(dsn, prepare_threshold=None, autocommit=True) as conn:
            answers.append((conn.info.port, reaches_server_directly(conn)))
    pooled_port, direct_port = answers[0][0], answers[2][0]
    assert pooled_port != direct_port
    assert answers == [
        (pooled_port, False),
        (pooled_port, False),
        (direct_port, True),
        (direct_port, True),
    ]
    assert sent == [pooled_port, direct_port]


async def test_no_connection_to_a_pooled_address_prepares_and_it_is_said_once(
    pooled_dsn: str, sent: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce")
    what = f"relay-{uuid.uuid4().hex[:8]}"
    port = 0
    for _ in range(3):
        async with await psycopg.AsyncConnection.connect(pooled_dsn, autocommit=True) as conn:
            assert conn.prepare_threshold == 5  # psycopg's default
            assert await own_prepare_threshold(conn, what) is None
            assert conn.prepare_threshold is None
            port = conn.info.port
    assert sent == [port]
    said = [r.getMessage() for r in caplog.records if "through a pooler" in r.getMessage()]
    assert len(said) == 1
    assert what in said[0]
