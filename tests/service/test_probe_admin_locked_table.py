"""The console's reads are bounded: with a table locked (a migration, a VACUUM FULL) a page
answers 503 within the bound instead of holding its pooled connection for as long as the lock
lasts, where an open console tab, polling /admin/live, took the pool from the webhook deliveries."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg

from tests.service.test_serve import CONFIG, TOKEN, start

#: The console's own bound is 5 seconds; the client gives it room, but less than a lock lasts.
CLIENT_TIMEOUT = 20


def test_console_pages_answer_within_their_bound_on_a_locked_table(
    direct_dsn: str, tmp_path: Path
) -> None:
    service = start(direct_dsn, tmp_path, CONFIG)
    try:
        with psycopg.connect(direct_dsn) as lock:
            lock.execute("LOCK TABLE pgonce.inbox IN ACCESS EXCLUSIVE MODE")
            auth = ("admin", TOKEN)
            with httpx.Client(base_url=service.url, auth=auth, timeout=CLIENT_TIMEOUT) as client:
                for path in ("/admin/live", "/admin"):
                    started = time.monotonic()
                    answer = client.get(path)
                    assert answer.status_code == 503, (path, answer.status_code)
                    assert answer.headers["retry-after"]
                    assert time.monotonic() - started < CLIENT_TIMEOUT
            lock.rollback()
        with httpx.Client(base_url=service.url, auth=auth, timeout=CLIENT_TIMEOUT) as client:
            assert client.get("/admin").status_code == 200
    finally:
        service.stop()
