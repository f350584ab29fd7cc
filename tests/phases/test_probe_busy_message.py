"""The sync store's refusal of a phase inside a phase named ``time.gather``: the generated twin
had rewritten the source's ``asyncio.gather``, a function that does not exist. Both twins name
what runs two at once in words that hold for each."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import UsageError
from pgonce.phases import PhaseStore
from tests.phases.racer import FP, T0


def test_the_sync_refusal_of_two_at_once_names_no_function_that_does_not_exist(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "t", "busy", FP, now=T0)

    def outer(conn: psycopg.Connection[Any]) -> int:
        op.phase("inner", lambda c: 1, now=T0)
        return 2

    with pytest.raises(UsageError, match="one phase, call or write at a time") as refused:
        op.phase("outer", outer, now=T0)
    assert "time.gather" not in str(refused.value)
    assert "two at once (tasks gathered, threads)" in str(refused.value)
