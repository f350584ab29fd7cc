"""A heartbeat that stops while its renewals are failing says so: the warning of the run's first
failure promised further tries, and the call's end must not leave that run without its end."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import psycopg
import pytest

from pgonce.store.heartbeat import AsyncHeartbeat, Heartbeat

BEAT = timedelta(milliseconds=10)


def test_a_heartbeat_stopped_during_a_run_of_failures_logs_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed_twice = threading.Event()
    count = [0]

    def renew() -> None:
        count[0] += 1
        if count[0] >= 2:
            failed_twice.set()
        raise psycopg.OperationalError("the server closed the connection")

    with caplog.at_level("DEBUG", logger="pgonce.phases"), Heartbeat(renew, BEAT) as heartbeat:
        assert failed_twice.wait(timeout=10)
    assert heartbeat.failures >= 2
    ends = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert len(ends) == 1
    assert ends[0].levelname == "WARNING"
    assert f"after {heartbeat.failures} failed renewals in a row" in ends[0].getMessage()


async def test_the_async_heartbeat_stopped_during_failures_logs_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed_twice = asyncio.Event()
    count = [0]

    async def renew() -> None:
        count[0] += 1
        if count[0] >= 2:
            failed_twice.set()
        raise psycopg.OperationalError("the server closed the connection")

    with caplog.at_level("DEBUG", logger="pgonce.phases"):
        async with AsyncHeartbeat(renew, BEAT) as heartbeat:
            await asyncio.wait_for(failed_twice.wait(), 10)
    ends = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert len(ends) == 1
    assert f"after {heartbeat.failures} failed renewals in a row" in ends[0].getMessage()


def test_a_heartbeat_that_ends_healthy_logs_no_end(caplog: pytest.LogCaptureFixture) -> None:
    renewed = threading.Event()

    def renew() -> None:
        renewed.set()

    with caplog.at_level("DEBUG", logger="pgonce.phases"), Heartbeat(renew, BEAT):
        assert renewed.wait(timeout=10)
    assert not [r for r in caplog.records if "stopped" in r.getMessage()]
