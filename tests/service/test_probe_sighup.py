"""SIGHUP to the real ``pgonce serve`` (a reload as other servers take it, or a closed
terminal): the service says it does not reload and keeps serving, instead of dying at once
with its in-flight requests cut and no line said; SIGTERM then stops it as usual."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.test_serve import Service, start

CONFIG = '[server]\nlog_format = "json"\n'


@pytest.fixture
def service(dsn: str, tmp_path: Path) -> Iterator[Service]:
    running = start(dsn, tmp_path, CONFIG)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def _said(service: Service, words: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if words in service.log.read_text() or service.process.poll() is not None:
            return words in service.log.read_text()
        time.sleep(0.05)
    return False


def test_sighup_is_said_and_the_service_keeps_serving(service: Service) -> None:
    service.process.send_signal(signal.SIGHUP)
    assert _said(service, "SIGHUP"), (service.process.poll(), service.log.read_text())
    assert service.process.poll() is None
    assert httpx.get(service.url + "/healthz", timeout=10).status_code == 200
    assert "reload" in service.log.read_text()
    assert service.stop() == 0
