"""A batch claimed while another holds the relay's turn at the broker is not taken, at a stop, for
a waiting relay's registration.

With ``concurrency`` batches at the broker at once, a loop that claimed its batch waits for its
turn. A stop used to count it, in its line, as a "registration as a waiting relay" cut after 1 s.
Nothing of the batch was sent and no statement of it is in progress: the stop cancels it at once,
its claim rolls back, and the line speaks only of the batch at the broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import psycopg
import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import wait_until
from tests.outbox.test_probe_stop_while_blocked import (
    Recording,
    cut_lines,
    pending,
    relay_lines,
    run_then_stop,
)
from tests.outbox.test_probe_stop_while_connecting import in_transaction

__all__ = ["relay_lines"]


class Unanswered:
    """A broker that takes the rows and never answers: a batch stays at the broker."""

    name = "unanswered"

    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        self.published.extend(str(m.message_id) for m in batch)
        await asyncio.Event().wait()
        return PublishResult()

    async def close(self) -> None:
        pass


async def test_stop_cancels_a_claimed_batch_waiting_for_its_turn_at_once(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(direct_dsn) as conn:
        for aggregate in ("1", "2"):
            enqueue(conn, "order", aggregate, "created", {"n": aggregate})
    publisher = Unanswered()
    # One batch at the broker at a time: the first keeps the turn, unanswered; the other loop
    # claims the second row and waits for the turn, its transaction idle.
    relay = Relay(direct_dsn, publisher, listen=False, concurrency=1, batch_size=1)
    relay.stop_grace = timedelta(milliseconds=1500)
    await run_then_stop(
        relay,
        lambda: wait_until(lambda: publisher.published and in_transaction(direct_dsn) == 2),
    )
    (line,) = cut_lines(caplog)
    assert "1 batch(es) at the broker, not settled within 1.5 s" in line
    assert "their 1 rows were not marked" in line
    assert "registration" not in line
    assert "claim(s)" not in line
    # The second batch never reached the broker.
    assert len(publisher.published) == 1
    # Neither row was marked nor counted an attempt; the next run publishes both.
    assert pending(direct_dsn) == (2, 0)
    recording = Recording()
    await Relay(direct_dsn, recording, listen=False).drain()
    assert pending(direct_dsn) == (0, None)
    assert len(set(recording.published)) == 2
