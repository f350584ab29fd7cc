"""A worker whose LISTEN goes through PgBouncer in transaction mode checks, at start, whether a
notification reaches it (up to LISTEN_CHECK, 5 s, since through that pooler none does). A stop
requested during that check waited for its end; it now ends the check at once."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce.store._async import notify
from pgonce.webhooks import worker as worker_module
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source


async def test_a_stop_during_the_listen_check_is_prompt(
    direct_dsn: str, pgbouncer_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled = make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])
    checking = asyncio.Event()
    hears = notify.hears

    async def observed(*args: Any, **kwargs: Any) -> bool:
        checking.set()
        return await hears(*args, **kwargs)

    monkeypatch.setattr(worker_module, "hears", observed)
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
