"""The completer's failed passes are counted, as the sweeper's are: a database that stays away
shows in ``pgonce_completer_failures``, while the log says it once, and once when it is back."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from psycopg_pool import AsyncConnectionPool

from pgonce.phases import AsyncPhaseStore
from pgonce.service.metrics import ServiceMetrics
from pgonce.store._async.phases import complete_every
from tests.phases import operations


async def test_failed_completer_passes_are_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = ServiceMetrics()
    stop = asyncio.Event()
    errors: list[Exception] = []

    def on_failure(error: Exception) -> None:
        errors.append(error)
        metrics.record_completer_failure(error)
        if len(errors) == 3:
            stop.set()

    caplog.set_level(logging.DEBUG, logger="pgonce.completer")
    # Nothing listens on port 1: every pass finds the pool without a connection.
    pool = AsyncConnectionPool(
        "postgresql://postgres@127.0.0.1:1/test?connect_timeout=1",
        min_size=1,
        max_size=1,
        timeout=0.2,
        reconnect_timeout=60,
        open=False,
    )
    await pool.open(wait=False)
    try:
        await asyncio.wait_for(
            complete_every(
                pool,
                AsyncPhaseStore(),
                {"pay": operations.pay},
                stop,
                every=timedelta(milliseconds=10),
                on_failure=on_failure,
            ),
            timeout=30,
        )
    finally:
        await pool.close()
    warnings = [
        r for r in caplog.records if r.name == "pgonce.completer" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "tries again every" in warnings[0].getMessage()
    reason = type(errors[0]).__name__
    text = metrics.render().decode()
    assert f'pgonce_completer_failures_total{{reason="{reason}"}} 3.0' in text
