"""A sync psycopg connection given to the async worker's run_once() or replay() is a UsageError
that names the mix-up, not a TypeError out of ``async with conn.transaction()``."""

from __future__ import annotations

import psycopg
import pytest

from pgonce.errors import UsageError
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source, statuses
from tests.inbox.test_worker import deliver, delivery


async def test_run_once_and_replay_refuse_a_sync_connection(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("e1", {}))
    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA)
    with psycopg.connect(effects_dsn) as conn:
        with pytest.raises(UsageError, match="async psycopg connection"):
            await worker.run_once(conn)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="async psycopg connection"):
            await worker.replay(conn, "shop")  # type: ignore[arg-type]
    assert statuses(effects_dsn) == {"e1": "pending"}
