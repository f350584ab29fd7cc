"""The inbox worker behind PgBouncer in ``pool_mode = statement``.

Every batch is a transaction, which statement mode refuses at its BEGIN. The worker used to say
"inbox worker lost the database", as for an outage: the operator looked for a database that was
down, when it is the pool mode that has to change. It now logs, once, the ConfigError that a
claim of the key store meets there, naming the pool modes that work, and goes on trying (the
pooler may be reconfigured without restarting the worker).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from pgonce.errors import ConfigError
from pgonce.webhooks.worker import InboxWorker
from tests.conftest import SCHEMA
from tests.inbox.conftest import source
from tests.outbox.conftest import wait_until
from tests.pgbouncer import started_pgbouncer, through


async def test_a_worker_behind_statement_pooling_names_the_pool_modes_that_work(
    direct_dsn: str, server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce")
    failures: list[tuple[str, Exception]] = []
    with started_pgbouncer(server_dsn, pool_size=2, pool_mode="statement") as bouncer:
        worker = InboxWorker(
            [source()],
            dsn=through(bouncer, direct_dsn),
            listen_dsn=direct_dsn,
            schema=SCHEMA,
            concurrency=1,
            poll_interval=timedelta(milliseconds=50),
            on_connection_failure=lambda what, error: failures.append((what, error)),
        )
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            # Still trying: the second refusal comes after the first one's pause.
            await wait_until(lambda: sum(w == "worker" for w, _ in failures) >= 2, within=30)
        finally:
            stop.set()
            await running
    refused = [e for w, e in failures if w == "worker"]
    assert all(isinstance(e, ConfigError) for e in refused), refused
    said = [r for r in caplog.records if r.name == "pgonce.inbox" and r.levelno >= logging.WARNING]
    assert len(said) == 1, [r.getMessage() for r in said]  # once for the run of refusals
    message = said[0].getMessage()
    assert "statement pooling mode" in message
    assert "pool_mode = transaction" in message
    assert "lost the database" not in message
    assert "tries again" in message
