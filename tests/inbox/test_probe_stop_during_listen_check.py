"""A worker whose LISTEN goes through PgBouncer in transaction mode checks, at start, whether a
notification reaches it (up to LISTEN_CHECK, 5 s, since through that pooler none does). A stop
requested during that check waited for its end; it now ends the check at once."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce.webhooks import worker as worker_module
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.pgbouncer import listen_check_started


async def test_a_stop_during_the_listen_check_is_prompt(
    direct_dsn: str, pgbouncer_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled = make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])
    checking = listen_check_started(monkeypatch, worker_module)
    worker = InboxWorker(
        [source()],
        dsn=direct_dsn,
        listen_dsn=pooled,
        schema=SCHEMA,
        concurrency=1,
        poll_interval=timedelta(milliseconds=100),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(checking.wait(), 30)
    stop.set()
    started = time.perf_counter()
    await asyncio.wait_for(running, 30)
    took = time.perf_counter() - started
    assert took < 1.5, f"the stop waited {took:.1f} s for the LISTEN check"
