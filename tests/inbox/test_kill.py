"""kill -9 of a worker process mid-handler: the event stays pending, another worker runs it once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import psycopg
import pytest

from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, eventually, source, statuses
from tests.inbox.test_worker import deliver, delivery, row

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


async def test_kill_9_mid_handler_leaves_the_event_for_another_worker(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("evt_k", {"n": 1}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.inbox.worker_process",
        effects_dsn,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        # The handler has written its effect and is blocked inside the open transaction.
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        assert line.decode().strip() == "STARTED evt_k"
        os.kill(process.pid, signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    killed = await row(effects_dsn, "evt_k")
    assert (killed["status"], killed["attempts"]) == ("pending", 0)
    assert effects(effects_dsn) == []  # the killed handler's write was rolled back

    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        # PostgreSQL releases the row once it noticed the lost connection: poll until it did.
        claimed = 0

        async def run() -> None:
            nonlocal claimed
            claimed += (await worker.run_once(conn)).claimed

        for _ in range(250):
            await run()
            if claimed:
                break
            await asyncio.sleep(0.02)
        assert claimed == 1
        assert (await worker.run_once(conn)).claimed == 0
    await eventually(lambda: statuses(effects_dsn) == {"evt_k": "done"})
    assert [e for _, e, _ in effects(effects_dsn)] == ["evt_k"]
