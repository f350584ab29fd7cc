"""SIGTERM or SIGINT while ``pgonce serve`` loads its configuration (importing a source's handler,
which for a large application takes seconds): a stop asked for before the service was up, exit 0
as ``pgonce serve --help`` promises, not 143 or 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SLOW_MODULE = """
import sys

print("importing the handler", file=sys.stderr, flush=True)
sys.stdin.readline()  # an application that takes its time to import, until the signal


async def handle(event, conn):
    pass
"""

CONFIG = """
[sources.shop]
scheme = "generic-hmac"
secrets = ["env:PROBE_SHOP_SECRET"]
handler = "slow_handler:handle"
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_the_configuration_loads_exits_0(
    tmp_path: Path, signum: signal.Signals
) -> None:
    (tmp_path / "slow_handler.py").write_text(SLOW_MODULE)
    (tmp_path / "pgonce.toml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")}
    env.update(PROBE_SHOP_SECRET="a-secret", PYTHONPATH=str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--port", "0", "--config", "pgonce.toml"],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
        assert first == "importing the handler\n", (first, process.communicate(timeout=30))
        process.send_signal(signum)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in rest
    assert process.returncode == 0, rest
    assert rest.splitlines()[-1] == "pgonce: stopped before the service was up", rest
