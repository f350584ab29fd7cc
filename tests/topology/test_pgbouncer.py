"""pgonce behind PgBouncer 1.18 in transaction mode: what the pooled variants of the other test
files do not show.

- pgonce's own statements, with default settings everywhere (psycopg's prepare_threshold too):
  the first collision of prepared-statement names switches the process to unnamed statements,
  and no claim is ever lost, doubled or answered from another client's statement.
- the bounded wait of a duplicate, and its lock_timeout never reaching the next client of the
  same server session.
- LISTEN on a direct connection (``listen_dsn``) wakes an inbox worker whose other connections go
  through the pooler.
- the service finds the pooler by itself, and says in its first lines that wake-ups are polled;
  ``doctor`` says the same, and is content once a direct LISTEN connection is given.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, InFlight, KeyStore, Response, Won, fingerprint
from pgonce.database import reaches_server_directly, shares_server_sessions
from pgonce.errors import ConfigError, DatabaseError, UsageError
from pgonce.store import wire
from pgonce.webhooks.worker import InboxWorker
from tests.conftest import SCHEMA
from tests.inbox.conftest import create_effects, effects, eventually, source
from tests.inbox.test_worker import deliver, delivery
from tests.pgbouncer import running_pgbouncer

ROOT = Path(__file__).resolve().parents[2]
FP = fingerprint("pooled")


@pytest.fixture
def pooled_dsn(direct_dsn: str, pgbouncer_server_dsn: str) -> str:
    """The test's database through the suite's PgBouncer."""
    name = psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"]
    return psycopg.conninfo.make_conninfo(pgbouncer_server_dsn, dbname=name)


def test_the_pooler_is_recognised_and_a_direct_connection_is_not(
    direct_dsn: str, pooled_dsn: str
) -> None:
    assert shares_server_sessions(pooled_dsn) is True
    assert shares_server_sessions(direct_dsn) is False
    for dsn, direct in ((pooled_dsn, False), (direct_dsn, True)):
        with psycopg.connect(dsn, prepare_threshold=None, autocommit=True) as conn:
            assert reaches_server_directly(conn) is direct


@pytest.fixture
def one_session_dsn(direct_dsn: str, server_dsn: str) -> Iterator[str]:
    """The test's database through a PgBouncer of one server session, which every client
    shares."""
    name = psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"]
    with running_pgbouncer(server_dsn, pool_size=1) as bouncer:
        yield psycopg.conninfo.make_conninfo(bouncer, dbname=name)


async def test_with_default_settings_claims_switch_to_unnamed_and_none_is_lost(
    one_session_dsn: str, direct_dsn: str
) -> None:
    # 8 clients, psycopg's defaults, the key store's defaults: pgonce's prepared statements meet
    # each other on PgBouncer's one shared session within the first transactions (with several,
    # a loaded machine could hand each client a session of its own until every session held
    # every statement under the same name, and no name ever crossed). From then on
    # pgonce's own statements go unnamed, and a connection that still lets psycopg prepare its
    # own is refused: its queries would run other clients' statements under their names.
    store = AsyncKeyStore()
    won: list[str] = []
    failed: list[str] = []
    refused: list[UsageError] = []
    conns = [await psycopg.AsyncConnection.connect(one_session_dsn) for _ in range(8)]

    async def client(conn: psycopg.AsyncConnection[Any], number: int) -> None:
        for n in range(40):
            key = f"{number}-{n}"
            try:
                claim = await store.begin(conn, "s", key, FP)
                assert isinstance(claim, Won)
                await store.commit(conn, claim, Response(201))
            except UsageError as error:
                refused.append(error)
            except DatabaseError:
                failed.append(key)  # a completion caught by the switch: rolled back, key free
            else:
                won.append(key)

    try:
        await asyncio.gather(*(client(c, i) for i, c in enumerate(conns)))
    finally:
        for conn in conns:
            await conn.close()
    assert wire.statements_unnamed()
    assert wire.statements_crossed()
    assert refused
    assert all("prepare_threshold=None" in str(e) for e in refused)
    # Only a completion already on its way when the names collided can fail (begin() runs again
    # from BEGIN): at most twice per connection, never after the switch.
    assert len(failed) <= 2 * len(conns)
    with psycopg.connect(direct_dsn) as check:
        stored = {row[0] for row in check.execute("SELECT key FROM pgonce.keys").fetchall()}
    assert stored == set(won)  # every success committed, every failure left nothing behind
    # A connection without psycopg's prepared statements goes on as before.
    async with await psycopg.AsyncConnection.connect(
        one_session_dsn, prepare_threshold=None
    ) as conn:
        claim = await store.begin(conn, "s", "after", FP)
        assert isinstance(claim, Won)
        assert await store.commit(conn, claim, Response(201))


def test_a_pooler_in_statement_mode_is_a_configuration_error(
    direct_dsn: str, server_dsn: str
) -> None:
    # Every claim is a transaction; PgBouncer's statement mode refuses them all. Answered as an
    # outage (503, retry) the client would retry forever: it is the configuration that is wrong.
    name = psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"]
    with running_pgbouncer(server_dsn, pool_size=2, pool_mode="statement") as bouncer:
        dsn = psycopg.conninfo.make_conninfo(bouncer, dbname=name)
        with (
            psycopg.connect(dsn, prepare_threshold=None, autocommit=True) as conn,
            pytest.raises(ConfigError, match="pool_mode = transaction"),
        ):
            KeyStore().begin(conn, "s", "k", FP)


def test_the_bounded_wait_and_lock_timeout_stay_in_their_transaction(pooled_dsn: str) -> None:
    store = KeyStore()
    with (
        psycopg.connect(pooled_dsn, prepare_threshold=None) as first,
        psycopg.connect(pooled_dsn, prepare_threshold=None) as second,
        psycopg.connect(pooled_dsn, prepare_threshold=None) as third,
    ):
        assert isinstance(store.claim(first, "s", "k", FP), Won)  # first holds its session
        outcome = store.claim(second, "s", "k", FP, wait=timedelta(milliseconds=200))
        assert outcome == InFlight(retry_after=store.retry_after, reason="locked")
        row = second.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        session = row[0]
        second.rollback()  # the server session goes back to PgBouncer, to the next client
        in_flight = store.begin(third, "s", "k", FP, wait=timedelta(milliseconds=200))
        assert in_flight == InFlight(retry_after=store.retry_after, reason="locked")
        after = third.execute("SELECT pg_backend_pid(), current_setting('lock_timeout')")
        assert after.fetchone() == (session, "0")


async def test_listen_dsn_wakes_a_worker_whose_other_connections_are_pooled(
    pooled_dsn: str, direct_dsn: str
) -> None:
    create_effects(direct_dsn)
    worker = InboxWorker(
        [source()],
        dsn=pooled_dsn,
        listen_dsn=direct_dsn,
        schema=SCHEMA,
        poll_interval=timedelta(minutes=10),  # only a notification can wake it in time
        connect_kwargs={"prepare_threshold": None},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await eventually(lambda: _listening(direct_dsn), within=10)
        await deliver(pooled_dsn, delivery("e1", {}))
        await eventually(lambda: len(effects(direct_dsn)) == 1, within=10)
    finally:
        stop.set()
        await task


def _listening(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query ILIKE 'LISTEN%%'"
        ).fetchone()
    return bool(row and row[0])


def test_serve_finds_the_pooler_and_says_wake_ups_are_polled(
    pooled_dsn: str, tmp_path: Path
) -> None:
    from tests.service.test_serve import start

    service = start(pooled_dsn, tmp_path, config='[server]\nlog_format = "text"\n')
    try:
        assert service.stop() == 0
    finally:
        if service.process.poll() is None:
            service.process.kill()
    log = service.log.read_text()
    assert 'running as pooler = "pgbouncer-transaction"' in log
    assert "LISTEN through a transaction-mode pooler receives nothing" in log
    assert "listen_dsn" in log


def test_doctor_warns_without_a_direct_listen_connection(pooled_dsn: str, direct_dsn: str) -> None:
    def doctor(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pgonce", "doctor", "--dsn", pooled_dsn],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    pooled = doctor()
    assert pooled.returncode == 0, pooled.stderr
    assert "WARN listen (database, *): LISTEN through a transaction-mode pooler" in pooled.stdout
    direct = doctor(PGONCE_LISTEN_DSN=direct_dsn)
    assert "listen_dsn, direct" in direct.stdout
    assert "WARN listen" not in direct.stdout
