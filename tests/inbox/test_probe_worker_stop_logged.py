"""A stop whose batches all finish within ``shutdown_timeout`` says nothing of a cut (the stop
that cuts one says so once: tests/inbox/test_worker.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, eventually, source
from tests.inbox.test_worker import deliver, delivery


async def test_a_stop_that_waits_for_its_batches_says_nothing(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA, concurrency=2)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await eventually(lambda: bool(effects(effects_dsn)), within=10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not [r for r in caplog.records if "shutdown timeout" in r.getMessage()]
