"""An inbox worker in a process of its own, for the kill -9 test.

``python -m tests.inbox.worker_process DSN`` runs a worker whose handler writes its effect, prints
``STARTED <event id>`` and then blocks forever: the test kills the process at that moment.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import psycopg

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, record_effect, source


async def blocking_handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    await record_effect(event, conn)
    print(f"STARTED {event.id}", flush=True)
    await asyncio.Event().wait()


async def main(dsn: str) -> None:
    worker = InboxWorker([source(handler=blocking_handler)], dsn=dsn, schema=SCHEMA)
    await worker.run(asyncio.Event())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
