"""/readyz and /metrics of a real `pgonce serve` answer within a bound whatever the database does:
a table locked for as long as a migration takes, or a network that stopped answering."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.service.test_serve import Service, start
from tests.stalling import proxy_to, through

CONFIG = """
[server]
log_format = "json"
"""


@pytest.fixture
def service(direct_dsn: str, tmp_path: Path) -> Iterator[Service]:
    with serving(direct_dsn, tmp_path, CONFIG) as running:
        yield running


@contextmanager
def serving(dsn: str, tmp_path: Path, config: str) -> Iterator[Service]:
    """`pgonce serve` with `config`, stopped on the way out unless it has already ended."""
    running = start(dsn, tmp_path, config)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def timed_get(url: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = httpx.get(url, timeout=90)
    return answer, time.monotonic() - started


def test_a_locked_ledger_makes_readyz_unready_within_its_bound(
    direct_dsn: str, service: Service
) -> None:
    # A migration's ALTER TABLE holds its lock for as long as it runs: the probe waited on it,
    # holding its pooled connection, for as long as the lock lasted.
    assert httpx.get(f"{service.url}/readyz").status_code == 200
    with psycopg.connect(direct_dsn) as locker:
        locker.execute(
            "LOCK TABLE pgonce.schema_migrations, pgonce.inbox, pgonce.outbox "
            "IN ACCESS EXCLUSIVE MODE"
        )
        ready, took = timed_get(f"{service.url}/readyz")
        assert ready.status_code == 503, ready.text
        assert took < 9
        scraped, took = timed_get(f"{service.url}/metrics")
        assert scraped.status_code == 200
        assert "pgonce_database_up 0.0" in scraped.text
        assert took < 9
        locker.rollback()
    assert httpx.get(f"{service.url}/readyz").status_code == 200


def test_a_stalled_network_makes_readyz_unready_within_its_bound(
    direct_dsn: str, tmp_path: Path
) -> None:
    # Requests reach the server, answers never come back: no statement timeout's error arrives,
    # and psycopg's own cancellation waits for the server too.
    with proxy_to(direct_dsn) as proxy:
        running = start(through(proxy, direct_dsn), tmp_path, CONFIG)
        try:
            assert httpx.get(f"{running.url}/readyz").status_code == 200
            proxy.hold(True)
            ready, took = timed_get(f"{running.url}/readyz")
            assert ready.status_code == 503, ready.text
            assert took < 15
            alive = httpx.get(f"{running.url}/healthz", timeout=5)
            assert alive.status_code == 200
        finally:
            proxy.hold(False)
            running.process.kill()
            running.process.wait(timeout=30)


def test_a_stalled_network_ends_every_scrape_within_its_bound_with_the_last_figures(
    direct_dsn: str, tmp_path: Path
) -> None:
    # A scrape waited 80 s on a stalled network, and every scrape meanwhile took one more pooled
    # connection for as long. Now the backlog reads give up at their own bound (10 s), one scrape
    # reads at a time, and each answers with the figures read last, saying why they are old.
    import concurrent.futures

    with proxy_to(direct_dsn) as proxy:
        running = start(through(proxy, direct_dsn), tmp_path, CONFIG)
        try:
            first = httpx.get(f"{running.url}/metrics", timeout=90)
            assert "pgonce_database_up 1.0" in first.text
            assert 'pgonce_outbox_rows{state="pending"} 0.0' in first.text
            proxy.hold(True)
            with concurrent.futures.ThreadPoolExecutor(3) as scrapers:
                answers = list(scrapers.map(timed_get, [f"{running.url}/metrics"] * 3))
            for scraped, took in answers:
                assert scraped.status_code == 200
                assert took < 15
                assert "pgonce_database_up 0.0" in scraped.text
                # The last figures read, not none.
                assert 'pgonce_outbox_rows{state="pending"} 0.0' in scraped.text
            # Each scrape counted, the last one to render saw all three.
            failures = 'pgonce_metrics_read_failures_total{reason="no_answer"} 3.0'
            assert any(failures in scraped.text for scraped, _ in answers)
        finally:
            proxy.hold(False)
            running.process.kill()
            running.process.wait(timeout=30)


def test_readyz_and_metrics_after_the_servers_sessions_ended_see_the_database_at_once(
    direct_dsn: str, service: Service
) -> None:
    # A restart or failover ends every pooled session; the probe said "unavailable" once per
    # idle connection of the pool while the database answered.
    assert httpx.get(f"{service.url}/readyz").status_code == 200
    end_sessions(direct_dsn)
    for _ in range(3):
        ready = httpx.get(f"{service.url}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
    end_sessions(direct_dsn)
    for _ in range(3):
        scraped = httpx.get(f"{service.url}/metrics", timeout=90)
        assert "pgonce_database_up 1.0" in scraped.text


def end_sessions(dsn: str) -> None:
    """Every other session on the database ended, as a restart or failover ends them."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (conninfo_to_dict(dsn)["dbname"],),
        )
