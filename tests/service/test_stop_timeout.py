"""``[server] stop_timeout``: how long a stop waits for the requests, inbox handlers and relay
batches under way. An operator sets it below the grace the orchestrator gives before SIGKILL
(Kubernetes' 30 s by default), so that what the stop cuts is answered 503, not reset.

With ``stop_timeout = "1s"``, one SIGTERM cuts a delivery waiting on a lock after a second (the
default 30 s would wait for the delivery's own 5 s lock bound, which answers "could not be
stored"), and cancels a handler that runs for an hour after a second (the default: 30 s)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg
import pytest

from pgonce.errors import ConfigError
from pgonce.service.config import DEFAULT_STOP_TIMEOUT, load
from tests.service.handlers import SLEEP
from tests.service.test_probe_stop_cuts_delivery import CONFIG, delivered_during_stop, signed
from tests.service.test_serve import Service, start

SHORT = CONFIG.replace("[server]\n", '[server]\nstop_timeout = "1s"\n')
assert SHORT != CONFIG

HANDLER = """
[server]
log_format = "json"
stop_timeout = "1s"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "tests.service.handlers:sleep_for_an_hour"
"""


def _loaded(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> timedelta:
    path = tmp_path / "pgonce.toml"
    path.write_text(text)
    return load(path, environ or {}).stop_timeout


def test_the_stop_timeout_is_read_from_the_file_and_the_environment(tmp_path: Path) -> None:
    assert _loaded(tmp_path, "") == DEFAULT_STOP_TIMEOUT == timedelta(seconds=30)
    assert _loaded(tmp_path, '[server]\nstop_timeout = "25s"\n') == timedelta(seconds=25)
    overridden = {"PGONCE__SERVER__STOP_TIMEOUT": "2m"}
    assert _loaded(tmp_path, '[server]\nstop_timeout = "25s"\n', overridden) == timedelta(minutes=2)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1ms", "server.stop_timeout: must be at least 1s (is 1ms a slip for minutes, m?)"),
        ("1.5s", "server.stop_timeout: must be whole seconds, not 1.5s"),
        ("0s", "server.stop_timeout: must be longer than 0s"),
        ("soon", "server.stop_timeout:"),
    ],
)
def test_a_stop_timeout_that_cannot_be_is_refused(tmp_path: Path, value: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _loaded(tmp_path, f'[server]\nstop_timeout = "{value}"\n')
    assert why in str(refused.value)


@pytest.fixture
def service(direct_dsn: str, tmp_path: Path) -> Iterator[Service]:
    running = start(direct_dsn, tmp_path, SHORT)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def test_a_stop_cuts_a_delivery_after_the_stop_timeout(direct_dsn: str, service: Service) -> None:
    async def stop() -> None:
        service.process.send_signal(signal.SIGTERM)

    answer = delivered_during_stop(direct_dsn, service, "evt_stop_timeout", stop)
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.headers["retry-after"]
    # Cut by the stop's bound of a second, before the delivery's lock bound (5 s) answered it.
    assert "the service stopped" in answer.json()["detail"], answer.text
    assert service.process.wait(timeout=60) == 0
    assert "cut by the stop" in service.log.read_text()


def _sleeping(conn: psycopg.Connection[tuple[int]]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND state = 'active'", (SLEEP,)
    ).fetchone()
    return row is not None and row[0] > 0


def test_a_stop_cancels_a_handler_after_the_stop_timeout(direct_dsn: str, tmp_path: Path) -> None:
    service = start(direct_dsn, tmp_path, HANDLER)
    try:
        body, headers = signed("evt_long_handler")

        async def deliver() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as client:
                return await client.post(
                    service.url + "/webhooks/shop", content=body, headers=headers
                )

        assert asyncio.run(deliver()).status_code < 300
        with psycopg.connect(direct_dsn, autocommit=True) as look:
            deadline = time.monotonic() + 30
            while not _sleeping(look):
                assert time.monotonic() < deadline, "the handler never ran"
                time.sleep(0.05)
            service.process.send_signal(signal.SIGTERM)
            assert service.process.wait(timeout=60) == 0
            # Its batch rolled back: the event waits for the next worker, and the statement
            # was cancelled on the server, not left sleeping.
            assert not _sleeping(look)
            row = look.execute(
                "SELECT status FROM pgonce.inbox WHERE source = 'shop' AND event_id = %s",
                ("evt_long_handler",),
            ).fetchone()
        assert row == ("pending",)
        log = service.log.read_text()
        assert "still running 1 s after the stop" in log, log
    finally:
        if service.process.poll() is None:
            service.process.kill()
            service.process.wait()
