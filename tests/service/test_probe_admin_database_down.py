"""The console through the real ``pgonce serve`` while its database refuses connections: every
page answers 503 with Retry-After and says why, never a bare 500 with a traceback in the log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql

from tests.service.test_serve import CONFIG, TOKEN, Service, start

#: One pooled connection and a short wait: a refused reconnect is found within a second.
DOWN_CONFIG = CONFIG.replace(
    "[server]", '[database]\npool_min_size = 1\npool_max_size = 1\npool_wait = "1s"\n[server]'
)
PAGES = [
    "/admin",
    "/admin/keys?scope=s",
    "/admin/live",
    "/admin/events",
    "/admin/outbox",
    "/admin/health",
]


def _cut(server_dsn: str, name: str) -> None:
    """Refuse new connections to the test's own database and end the ones it has."""
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(name))
        )
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )


@pytest.fixture
def down(direct_dsn: str, server_dsn: str, tmp_path: Path) -> Iterator[Service]:
    running = start(direct_dsn, tmp_path, DOWN_CONFIG)
    name = str(psycopg.conninfo.conninfo_to_dict(direct_dsn)["dbname"])
    try:
        _cut(server_dsn, name)
        yield running
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(name))
            )
        if running.process.poll() is None:
            running.stop()


def test_console_pages_answer_503_while_the_database_refuses(down: Service) -> None:
    with httpx.Client(base_url=down.url, auth=("admin", TOKEN), timeout=30) as client:
        for path in PAGES:
            answer = client.get(path)
            assert answer.status_code == 503, (path, answer.status_code, answer.text[:200])
            assert "retry-after" in answer.headers, path
            assert TOKEN not in answer.text
            # A replay cut during its COMMIT may have happened: the page must not say otherwise.
            assert "nothing was changed" not in answer.text
        replay = client.post(
            "/admin/outbox/replay",
            content=b"csrf=x",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert replay.status_code in (403, 503), replay.status_code
    log = down.log.read_text()
    assert "Traceback" not in log
