"""Inbox workers run as a library behind PgBouncer 1.18 in transaction mode, with their defaults.

The service finds the pooler by itself and opens every connection with ``prepare_threshold=None``
(tests/topology/test_pgbouncer.py). An application that runs :class:`InboxWorker` itself, with a
DSN through the pooler and nothing else said (``PGONCE_POOLER`` unset, as ``pooler = "auto"`` is
the default), gets psycopg's automatic preparation on the worker's connections: after five runs
of a statement psycopg prepares it as ``_pg3_0``, ``_pg3_1``, … on a server session that the
pooler then lends to other clients, whose own ``_pg3_0`` is another statement. Every event must
still be handled exactly once, and the workers must keep running; where they cannot, they must
refuse loudly (as the key store does), never run another client's statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.webhooks.worker import InboxWorker
from tests.conftest import SCHEMA
from tests.inbox.conftest import create_effects, effects, eventually, source
from tests.inbox.test_worker import deliver, delivery


@pytest.fixture
def pooled_dsn(direct_dsn: str, pgbouncer_server_dsn: str) -> str:
    name = psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"]
    return psycopg.conninfo.make_conninfo(pgbouncer_server_dsn, dbname=name)


async def _other_client(dsn: str, stop: asyncio.Event, ran: list[int]) -> None:
    """An application's connection with psycopg's defaults: its own statements, prepared after
    five runs under the same names, on the same server sessions."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            for n in range(3):
                # Its own statements meet the workers' names too: not what is tested here.
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(f"SELECT {n}::int + %s::int", (1,))
            ran.append(1)
            await asyncio.sleep(0)


async def test_library_workers_with_defaults_handle_every_event_once(
    pooled_dsn: str,
    direct_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce")
    monkeypatch.delenv("PGONCE_POOLER", raising=False)
    monkeypatch.delenv("PGONCE_PREPARE_THRESHOLD", raising=False)
    create_effects(direct_dsn)
    failures: list[BaseException] = []
    workers = [
        InboxWorker(
            [source()],
            dsn=pooled_dsn,
            listen_dsn=direct_dsn,
            schema=SCHEMA,
            poll_interval=timedelta(milliseconds=50),
        )
        for _ in range(2)
    ]
    stop = asyncio.Event()
    ran: list[int] = []
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(w.run(stop)) for w in workers]
    tasks += [asyncio.create_task(_other_client(pooled_dsn, stop, ran)) for _ in range(2)]
    try:
        for n in range(60):
            await deliver(direct_dsn, delivery(f"e{n}", {"n": n}))
        await eventually(lambda: len(effects(direct_dsn)) >= 60, within=60)
    finally:
        stop.set()
        for task in tasks:
            try:
                await task
            except BaseException as error:
                failures.append(error)
    handled = [event for _, event, _ in effects(direct_dsn)]
    assert sorted(handled) == sorted(f"e{n}" for n in range(60))
    assert not failures, failures
    assert ran, "the other clients never ran"
    # A worker that ran a statement by a name another client prepared ("bind message supplies 1
    # parameters, but prepared statement "_pg3_1" requires 3") ran someone else's SQL; that it
    # failed here is luck of the parameter count.
    crossed = [r.getMessage() for r in caplog.records if 'prepared statement "' in r.getMessage()]
    assert not crossed, crossed
    # The workers found the pooler on their first connections, and it was said once.
    said = [r.getMessage() for r in caplog.records if "through a pooler" in r.getMessage()]
    assert len(said) == 1, said


async def test_the_library_relay_finds_the_pooler_on_its_first_connection(
    pooled_dsn: str,
    direct_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its connections run pgonce's statements and the caller's routing: psycopg must prepare
    # nothing there behind a pooler that lends their server sessions to other clients.
    caplog.set_level(logging.WARNING, logger="pgonce")
    monkeypatch.delenv("PGONCE_POOLER", raising=False)
    publisher = RedisStreamsPublisher("redis://127.0.0.1:6379/0", routing=lambda m: "unused")
    pooled, direct = Relay(pooled_dsn, publisher), Relay(direct_dsn, publisher)
    assert pooled.prepare_threshold == direct.prepare_threshold == 5
    for _ in range(2):
        async with await pooled.connect(pooled.dsn) as conn:
            assert conn.prepare_threshold is None
        async with await direct.connect(direct.dsn) as conn:
            assert conn.prepare_threshold == 5
    assert (pooled.prepare_threshold, direct.prepare_threshold) == (None, 5)
    said = [r.getMessage() for r in caplog.records if "through a pooler" in r.getMessage()]
    assert len(said) == 1, said
    assert "the outbox relay" in said[0]
    monkeypatch.setenv("PGONCE_POOLER", "none")  # said so: nothing is checked
    trusted = Relay(pooled_dsn, publisher)
    async with await trusted.connect(trusted.dsn) as conn:
        assert conn.prepare_threshold == 5
