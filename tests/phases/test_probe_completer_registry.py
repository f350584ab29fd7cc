"""The completer's registry with a work that cannot run (a name mapped to a string, to None).

Each pass took the abandoned requests of that operation over, failed them with a TypeError,
and once their attempts ran out retired them with a stored 500: a mistake of configuration
ended real requests for good. It is a UsageError at the pass now, before any takeover.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import UsageError
from pgonce.phases import PhaseStore
from tests.phases.racer import FP, T0


def test_a_registry_whose_work_cannot_run_retires_nothing(db: psycopg.Connection[Any]) -> None:
    store = PhaseStore()
    store.start(db, "s", "pay-1", FP, operation="pay", now=T0)
    later = T0 + timedelta(minutes=1)
    for attempt in range(3):
        with pytest.raises(UsageError, match="registered work of 'pay'"):
            store.complete(
                db,
                {"pay": "billing.pay"},  # type: ignore[dict-item]
                retire_after=1,
                now=later + timedelta(minutes=attempt),
            )
    row = db.execute(
        "SELECT k.completed_at, l.attempts FROM pgonce.keys AS k "
        "JOIN pgonce.key_leases AS l USING (scope, key) WHERE k.key = 'pay-1'"
    ).fetchone()
    assert row == (None, 1)
