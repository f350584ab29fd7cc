"""One pgonce service's outbox relayed over HTTP (Standard Webhooks) to another's inbox receiver.

A relay that dies after the endpoint acknowledged a row but before its mark committed leaves the
row pending, and the next relay sends it again with the same message id (``webhook-id``): the
documented recovery, which consumers answer as a duplicate. The receiver tells a duplicate from a
conflict by the body's digest, so the body must be the same at every delivery: the envelope's
timestamp is the event's, and only the signature's is the time of sending. A body with the time
of sending in it was answered 409 with an integrity alert, counted as a refusal, and after the
policy's attempts the row, delivered, was parked."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg

from pgonce import enqueue
from pgonce.core.outbox import OutboxMessage, RetryPolicy
from pgonce.publishers.http import HttpPublisher
from pgonce.relay import Relay
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import serve

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


async def test_a_row_sent_again_after_a_lost_mark_is_a_duplicate_for_pgonces_receiver(
    dsn: str,
) -> None:
    source = Source(name="orders", scheme=build_scheme("standard-webhooks", [SECRET]))
    receiver = InboxReceiver([source], dsn=dsn)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        enqueue(conn, "order", "42", "order.created", {"id": 42})
    with serve(receiver) as url:
        publisher = HttpPublisher(url=f"{url}/webhooks/orders", secret=SECRET)
        policy = RetryPolicy(max_attempts=1)
        first = await Relay(dsn, publisher, listen=False, policy=policy).drain()
        # The relay died after the endpoint's 200, before its mark committed.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE pgonce.outbox SET published_at = NULL")
        again = await Relay(dsn, publisher, listen=False, policy=policy).drain()
        await publisher.close()
    assert first.published == 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        stored = conn.execute("SELECT count(*) FROM pgonce.inbox").fetchone()
        row = conn.execute("SELECT parked_at IS NULL, last_error FROM pgonce.outbox").fetchone()
    assert stored == (1,)
    assert (again.published, again.parked, row) == (1, 0, (True, None))


def test_a_row_sent_later_has_the_same_body_and_a_new_signed_timestamp() -> None:
    created = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    times = iter([created + timedelta(seconds=5), created + timedelta(minutes=30)])
    publisher = HttpPublisher(
        url="http://hooks.example/in", secret=SECRET, clock=lambda: next(times)
    )
    message = OutboxMessage(
        id=7,
        aggregatetype="order",
        aggregateid="42",
        type="order.created",
        payload_json='{"id": 42}',
        headers={},
        created_at=created,
        attempts=0,
    )
    first_body, first_headers = publisher.request(message)
    again_body, again_headers = publisher.request(message)
    assert first_body == again_body
    assert first_body == (
        b'{"type":"order.created","timestamp":"2026-03-01T12:00:00Z","data":{"id":42}}'
    )
    assert (first_headers["webhook-timestamp"], again_headers["webhook-timestamp"]) == (
        str(int((created + timedelta(seconds=5)).timestamp())),
        str(int((created + timedelta(minutes=30)).timestamp())),
    )
    assert first_headers["webhook-signature"] != again_headers["webhook-signature"]
