"""`pgonce serve` on a stalled network: every start-up check ends within its bound, with one line.

The server accepts the connection (or has accepted it) and then never answers: a frozen host, a
half-dead load balancer, a firewall dropping the packets. The start used to wait for good on its
reachability check or its pooler detection, neither serving nor exiting.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.service.test_serve import free_port
from tests.stalling import freezing

ROOT = Path(__file__).resolve().parents[2]

#: Far above every bound the start-up checks have (database.ANSWER_TIMEOUT is 10 s), far below
#: forever.
LIMIT = 60


def serve(dsn: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "serve", "--dsn", dsn, "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )
    return result, time.monotonic() - started


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "serving on" not in result.stdout
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("pgonce: error:")]
    return line


@pytest.mark.parametrize(
    ("marker", "what"),
    [
        (b"SELECT 1", "checking the connection"),
        (b"pg_backend_pid", "checking for a transaction-mode pooler"),
    ],
    ids=["reachability check", "pooler detection"],
)
def test_a_server_that_stops_answering_ends_the_start_with_one_line(
    direct_dsn: str, marker: bytes, what: str
) -> None:
    with freezing(direct_dsn, marker) as proxy:
        result, seconds = serve(proxy.dsn(direct_dsn))
        assert proxy.frozen.is_set()
    line = error_line(result)
    assert line.startswith(f"pgonce: error: PostgreSQL at 127.0.0.1:{proxy.port}/"), line
    assert f"sent no answer within 10s ({what})" in line
    assert "stalled" in line
    assert seconds < 30


def test_a_server_that_never_answers_the_connection_ends_the_start_with_one_line(
    direct_dsn: str,
) -> None:
    with freezing(direct_dsn, None) as proxy:
        proxy.freeze()
        result, seconds = serve(proxy.dsn(direct_dsn))
    line = error_line(result)
    assert line.startswith(
        f"pgonce: error: cannot connect to PostgreSQL at 127.0.0.1:{proxy.port}/"
    ), line
    assert "no answer to the connection within 5s (connect_timeout)" in line
    assert seconds < 30


def test_a_worker_whose_server_stops_answering_at_the_schema_check_ends_with_one_line(
    direct_dsn: str, tmp_path: Path
) -> None:
    # `pgonce worker` and `pgonce relay` check the schema before they start: it waited for good.
    import os

    from tests.service.test_serve import CONFIG, SECRET, TOKEN

    config = tmp_path / "pgonce.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "TEST_SHOP_SECRET": SECRET, "TEST_ADMIN_TOKEN": TOKEN}
    with freezing(direct_dsn, b"coalesce(max(version), 0)") as proxy:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pgonce", "worker", "--config", str(config),
             "--dsn", proxy.dsn(direct_dsn)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT, check=False,
        )  # fmt: skip
        assert proxy.frozen.is_set()
    assert time.monotonic() - started < 30
    line = error_line(result)
    assert line.startswith(f"pgonce: error: PostgreSQL at 127.0.0.1:{proxy.port}/"), line
    assert "sent no answer within 10s (reading the schema version)" in line
