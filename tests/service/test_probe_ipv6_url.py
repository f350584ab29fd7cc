"""On an IPv6 address the service's URL (the "serving on" line, the URL the demo storms) puts the
address in brackets: "http://::1:8000" is no URL that a client or a browser can open."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.service.test_serve import ROOT


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_serving_url_of_an_ipv6_address_is_bracketed(dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text('[server]\nlog_format = "json"\n')
    log = tmp_path / "service.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--config", str(config), "--dsn", dsn,
         "--host", "::1", "--port", "0"],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = next((line for line in process.stdout if "serving on" in line), "")
        assert line, log.read_text()
        url = line.split("serving on ", 1)[1].strip()
        assert url.startswith("http://[::1]:"), url
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
