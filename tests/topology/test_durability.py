"""Durability you can see: a server configured for a synchronous standby that has none.

A scratch cluster of the test's own gets ``synchronous_standby_names`` and no standby (the shared
test server is never altered): the health check, ``pgonce doctor``, ``/readyz`` and ``/metrics``
must all say that no standby is in sync. The judgement itself is pure and checked for every state.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from pgonce.core.durability import Durability, judge_durability
from pgonce.store._sync.health import HealthCheck
from pgonce.store.migrate import migrate
from tests.service.test_serve import metric, start
from tests.topology.cluster import scratch_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("facts", "state", "status"),
    [
        (Durability(configured=False, synchronous=0, unknown=0), "not configured", "ok"),
        (Durability(configured=True, synchronous=1, unknown=0), "synchronous", "ok"),
        (Durability(configured=True, synchronous=0, unknown=0), "none", "warn"),
        (Durability(configured=True, synchronous=0, unknown=1), "unknown", "warn"),
    ],
)
def test_the_judgement_of_each_state(facts: Durability, state: str, status: str) -> None:
    assert facts.state == state
    finding = judge_durability(facts)
    assert finding.status == status
    assert (finding.detail != "") == (status == "warn")


def test_a_server_that_takes_no_writes_fails_the_check_and_names_the_fix() -> None:
    finding = judge_durability(
        Durability(configured=True, synchronous=1, unknown=0, read_only=True)
    )
    assert (finding.status, finding.value) == ("fail", "read-only")
    assert "target_session_attrs=read-write" in finding.detail


@pytest.fixture(scope="module")
def standby_missing() -> Iterator[str]:
    """A migrated scratch server that waits for a synchronous standby it does not have."""
    with scratch_cluster() as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, "pgonce")  # before: with no standby, a commit that writes would wait
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'pgonce_standby'")
            conn.execute("SELECT pg_reload_conf()")
        # The reload is asynchronous: a new session sees the setting once the postmaster has it.
        for _ in range(200):
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SHOW synchronous_standby_names").fetchone()
            if row == ("pgonce_standby",):
                break
        else:
            raise AssertionError("the server never took synchronous_standby_names")
        yield dsn


def test_the_health_check_reports_no_standby_in_sync(standby_missing: str) -> None:
    with psycopg.connect(standby_missing, autocommit=True) as conn:
        report = HealthCheck().check(conn)
    assert report.durability == Durability(configured=True, synchronous=0, unknown=0)
    [finding] = [f for f in report.findings if f.check == "sync standby"]
    assert (finding.status, finding.value) == ("warn", "none")


def test_the_shared_server_has_nothing_to_report(conn: psycopg.Connection[object]) -> None:
    durability = HealthCheck().durability(conn)
    assert durability.state == "not configured"


def test_doctor_warns_and_strict_fails(standby_missing: str) -> None:
    def doctor(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pgonce", "doctor", "--dsn", standby_missing, *extra]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)

    done = doctor()
    assert done.returncode == 0, done.stderr
    assert "WARN sync standby (database, *): synchronous_standby_names is set" in done.stdout
    assert doctor("--strict").returncode == 1


def test_readyz_and_metrics_say_durability_is_reduced(standby_missing: str, tmp_path: Path) -> None:
    service = start(standby_missing, tmp_path, config='[server]\nlog_format = "json"\n')
    try:
        ready = httpx.get(f"{service.url}/readyz").json()
        assert ready["status"] == "ready"
        assert (ready["synchronous_standby"], ready["durability"]) == ("none", "reduced")
        assert metric(service.url, "pgonce_sync_standby_configured") == 1
        assert metric(service.url, "pgonce_sync_standbys") == 0
    finally:
        assert service.stop() == 0
