"""A sweep batch cut by a timeout says which bound cut it and what usually holds it: the sweeper's
own statement timeout (with its value), or a lock_timeout the role or database sets. Both
surface from PostgreSQL as a bare "canceling statement due to ... timeout", which named neither
the bound nor where to look."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from pgonce.core.retention import SweepLimits
from pgonce.errors import DatabaseError
from pgonce.store._sync.sweeper import Sweeper, failure_summary, swept_before


def test_a_batch_cut_by_the_sweepers_statement_timeout_names_it(direct_dsn: str) -> None:
    limits = SweepLimits(statement_timeout=timedelta(milliseconds=300))
    with (
        psycopg.connect(direct_dsn) as lock,
        psycopg.connect(direct_dsn, autocommit=True) as conn,
    ):
        lock.execute("LOCK TABLE pgonce.inbox IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(DatabaseError) as caught:
            Sweeper(limits=limits).sweep(conn)
        lock.rollback()
        # The next run, the lock gone, sweeps.
        assert Sweeper(limits=limits).sweep(conn).deleted == 0
    message = str(caught.value)
    assert "sweeping inbox failed" in message
    assert "statement timeout of 300ms" in message
    assert "pg_locks" in message
    assert isinstance(caught.value.__cause__, psycopg.errors.QueryCanceled)
    # The other targets were still swept, and the summary still counts them.
    assert swept_before(caught.value) == {
        "keys": 0,
        "inbox": 0,
        "outbox": 0,
        "outbox_aggregates": 0,
    }
    assert "statement timeout of 300ms" in failure_summary(caught.value)


def test_a_batch_cut_by_a_lock_timeout_of_the_role_names_it(direct_dsn: str) -> None:
    # As `ALTER ROLE ... SET lock_timeout` would give every session of the role.
    with (
        psycopg.connect(direct_dsn) as lock,
        psycopg.connect(direct_dsn, autocommit=True, options="-c lock_timeout=50ms") as conn,
    ):
        lock.execute("LOCK TABLE pgonce.outbox IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(DatabaseError) as caught:
            Sweeper().sweep(conn)
        lock.rollback()
    message = str(caught.value)
    assert "sweeping outbox failed" in message
    assert "lock_timeout" in message
    assert "pg_locks" in message
    assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable)
