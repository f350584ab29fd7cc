"""A redelivery whose stored event vanishes under it (the sweeper deleted the row between the
store's claim and its read-back) is answered 503 with Retry-After, and named ``swept``: not
``unavailable``, which says the database could not be reached, so an alert on that outcome does not
fire for a routine retention race."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import psycopg

from pgonce.webhooks.receiver import InboxReceiver, Outcome
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.service.test_serve import SECRET

SHOP = build_scheme("standard-webhooks", [SECRET])
BODY = b'{"type": "order.created"}'


class Answer:
    def __init__(self) -> None:
        self.messages: list[MutableMapping[str, Any]] = []

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])


async def deliver(receiver: InboxReceiver, event_id: str) -> tuple[Outcome, Answer]:
    headers = [
        (k.lower().encode(), v.encode()) for k, v in SHOP.sign(BODY, event_id=event_id).items()
    ]
    scope = {"type": "http", "method": "POST", "path": "/webhooks/shop", "headers": headers}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": BODY, "more_body": False}

    answer = Answer()
    return await receiver.respond(scope, receive, answer.send), answer


async def lock_waits(conn: psycopg.AsyncConnection[Any], count: int) -> None:
    """Until ``count`` backends wait on a lock (the receiver's store, blocked on a deletion)."""
    while True:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        row = await cur.fetchone()
        assert row is not None
        if row[0] >= count:
            return
        await asyncio.sleep(0.01)


async def test_a_delivery_whose_event_is_being_swept_is_counted_as_swept(direct_dsn: str) -> None:
    async with InboxReceiver([Source("shop", SHOP)], dsn=direct_dsn, flushers=1) as receiver:
        for event in ("a", "b", "z"):
            assert (await deliver(receiver, event))[0] == "stored"
        watch = await psycopg.AsyncConnection.connect(direct_dsn, autocommit=True)
        first = await psycopg.AsyncConnection.connect(direct_dsn)
        second = await psycopg.AsyncConnection.connect(direct_dsn)
        try:
            await first.execute("DELETE FROM pgonce.inbox WHERE event_id = 'z'")
            await second.execute("DELETE FROM pgonce.inbox WHERE event_id = 'b'")
            # The one flusher waits on z's deletion; a and b queue up behind it, one batch.
            z = asyncio.ensure_future(deliver(receiver, "z"))
            await lock_waits(watch, 1)
            a = asyncio.ensure_future(deliver(receiver, "a"))
            b = asyncio.ensure_future(deliver(receiver, "b"))
            await asyncio.sleep(0)  # each runs to its queued store without a wait of its own
            assert len(receiver._queue) == 2
            await first.commit()
            assert (await z)[0] == "stored"
            # The batch claimed a (present, committed: nothing to insert) and waits on b's
            # deletion; a is deleted and committed before the batch reads its conflicts back.
            await lock_waits(watch, 1)
            await second.execute("DELETE FROM pgonce.inbox WHERE event_id = 'a'")
            await second.commit()
            (outcome, answer), (b_outcome, _) = await a, await b
        finally:
            for conn in (watch, first, second):
                await conn.close()
    assert b_outcome == "stored"
    assert b"being cleaned up" in answer.messages[1]["body"]
    assert outcome == "swept"
    assert answer.status == 503
    assert (b"retry-after", b"1") in answer.messages[0]["headers"]
