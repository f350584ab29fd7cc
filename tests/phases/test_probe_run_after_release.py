"""``run()`` ends the lease of a work that fails, and lets its error propagate. A work that had
released its key (a request refused after all) or stored its answer itself, and then raised, had
its error replaced by a UsageError from that end of lease: "the key was released", "already
finished", for an end of lease that had nothing left to end."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import Response
from pgonce.phases import AsyncPhasedOperation, AsyncPhaseStore, PhasedOperation, PhaseStore
from tests.phases.racer import FP, T0


class Refused(Exception):
    """The application's own refusal of a request."""


def refuse(op: PhasedOperation[Any]) -> Response:
    op.release(now=T0)
    raise Refused("amount must be positive")


def answer_then_fail(op: PhasedOperation[Any]) -> Response:
    op.finish(Response(201, body=b"paid"), now=T0)
    raise Refused("the receipt printer is down")


def test_a_work_that_released_its_key_and_raised_propagates_its_error(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    op = store.start(db, "t", "refused", FP, now=T0)
    with pytest.raises(Refused, match="amount must be positive"):
        op.run(refuse, now=T0)
    # The key is free: the next request with it is a new claim.
    assert store.start(db, "t", "refused", FP, now=T0).won


def test_a_work_that_stored_its_answer_and_raised_propagates_its_error(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    op = store.start(db, "t", "answered", FP, now=T0)
    with pytest.raises(Refused, match="the receipt printer is down"):
        op.run(answer_then_fail, now=T0)
    again = store.start(db, "t", "answered", FP, now=T0)
    assert again.replayed
    assert again.response == Response(201, body=b"paid")


async def test_an_async_work_that_released_its_key_and_raised_propagates_its_error(
    dsn: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "t", "async", FP, now=T0)

        async def work(op: AsyncPhasedOperation[Any]) -> Response:
            await op.release(now=T0)
            raise Refused("amount must be positive")

        with pytest.raises(Refused, match="amount must be positive"):
            await op.run(work, now=T0)
