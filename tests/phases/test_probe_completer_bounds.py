"""The completer's bounds that PostgreSQL cannot take, or that leave every request alone.

A ``max_age`` of zero or less took no request, in silence; one of a million years failed every
pass as "timestamp out of range", as did a ``limit`` beyond a bigint ("bigint out of range"):
DatabaseErrors for a wrong argument, retried for ever by the loop. Each is a UsageError now.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import Response, UsageError
from pgonce.phases import PhaseStore
from pgonce.store._async.phases import AsyncPhaseStore, complete_every


def finish(op: Any) -> Response:
    return Response(201)


@pytest.mark.parametrize(
    "max_age", [timedelta(0), timedelta(seconds=-1), timedelta(days=10**8), timedelta.max]
)
def test_a_max_age_the_completer_cannot_use_is_a_usage_error(
    db: psycopg.Connection[Any], max_age: timedelta
) -> None:
    store = PhaseStore()
    with pytest.raises(UsageError, match="max_age must be positive"):
        store.complete(db, {"pay": finish}, max_age=max_age)
    with pytest.raises(UsageError, match="max_age must be positive"):
        store.abandoned(db, max_age=max_age)
    with pytest.raises(UsageError, match="max_age must be positive"):
        store.resume(db, "s", "k", max_age=max_age)


def test_a_limit_beyond_a_bigint_is_a_usage_error(db: psycopg.Connection[Any]) -> None:
    with pytest.raises(UsageError, match="limit must be at most"):
        PhaseStore().abandoned(db, limit=2**63)


async def test_the_completer_loop_refuses_a_max_age_at_its_start() -> None:
    async def pay(op: Any) -> Response:
        return Response(201)

    with pytest.raises(UsageError, match="max_age must be positive"):
        await complete_every(
            None,  # type: ignore[arg-type]
            AsyncPhaseStore(),
            {"pay": pay},
            asyncio.Event(),
            max_age=timedelta(0),
        )
