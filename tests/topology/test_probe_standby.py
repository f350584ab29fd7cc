"""The health check and ``pgonce doctor`` pointed at a hot standby (a DSN that reached a replica,
or the old primary a failover demoted): a standby refuses to read the unlogged
``outbox_aggregates`` table before anything else, and that must read as the read-only node it is,
with the fix, not as an unexplained database failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pgonce import AsyncHealthCheck, HealthCheck
from pgonce.errors import DatabaseUnavailable
from tests.topology.test_failover import primary_and_standby

__all__ = ["primary_and_standby"]  # the fixture, used by name below

ROOT = Path(__file__).resolve().parents[2]
FIX = "list every node in the DSN with target_session_attrs=read-write"


def test_the_health_check_on_a_standby_says_it_takes_no_writes(
    primary_and_standby: tuple[str, str],
) -> None:
    # Before: DatabaseError "checking health failed: cannot access temporary or unlogged
    # relations during recovery", with nothing saying the node is a standby.
    _, standby = primary_and_standby
    with (
        psycopg.connect(standby, autocommit=True) as conn,
        pytest.raises(DatabaseUnavailable, match=FIX) as raised,
    ):
        HealthCheck().check(conn)
    assert isinstance(raised.value.__cause__, psycopg.errors.FeatureNotSupported)


async def test_the_async_health_check_on_a_standby_says_it_takes_no_writes(
    primary_and_standby: tuple[str, str],
) -> None:
    _, standby = primary_and_standby
    async with await psycopg.AsyncConnection.connect(standby, autocommit=True) as conn:
        with pytest.raises(DatabaseUnavailable, match=FIX):
            await AsyncHealthCheck().check(conn)


def test_doctor_on_a_standby_names_the_fix_in_one_line(
    primary_and_standby: tuple[str, str],
) -> None:
    _, standby = primary_and_standby
    done = subprocess.run(
        [sys.executable, "-m", "pgonce", "doctor", "--dsn", standby],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("pgonce: error: checking health failed: "), done.stderr
    assert "a standby" in last, done.stderr
    assert FIX in last, done.stderr
