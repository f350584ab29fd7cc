"""The NATS JetStream publisher when the stream is not where the relay sends: deleted while the
relay runs, or a subject that a plain subscriber answers instead of a stream.

Each test has its own stream and subjects, deleted afterwards: the server is shared.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from datetime import timedelta

import nats
import psycopg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from pgonce.publishers.nats import NatsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import nats_read, nats_stream
from tests.outbox.conftest import fresh, outbox_rows, wait_until
from tests.outbox.stops import running


@pytest.fixture
async def plain(nats_url: str) -> AsyncIterator[Client]:
    """A second client, for subscribers of the core NATS kind (no stream)."""
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()


async def answer(msg: Msg) -> None:
    # What a request-reply service on the subject does with any message that asks for an answer.
    await msg.respond(b"ok")


async def test_a_subscriber_that_answers_where_no_stream_is_refuses_the_row(
    nats_url: str, plain: Client
) -> None:
    subject = fresh("pgonce.plain.")
    await plain.subscribe(subject, cb=answer)
    await plain.flush()
    publisher = NatsPublisher(
        nats_url, routing=lambda m: subject, ack_timeout=timedelta(milliseconds=500)
    )
    try:
        result = await publisher.publish(outbox_rows(2))
    finally:
        await publisher.close()
    # Its answer is no PubAck: acknowledged, the rows would be marked published while no stream
    # stored them. Refused, they count attempts and are parked in the end, the subject named.
    assert result.acked == frozenset()
    assert result.lost is None
    assert set(result.refused) == {1, 2}
    assert result.refused[1] == (
        f"no stream covers the subject {subject!r}: a subscriber of it answered the message, "
        "and no JetStream acknowledgement came within 0.5 s"
    )


async def test_a_subscriber_that_never_answers_where_no_stream_is_is_named_as_a_cause(
    nats_url: str, plain: Client
) -> None:
    subject = fresh("pgonce.silent.")
    await plain.subscribe(subject)
    await plain.flush()
    publisher = NatsPublisher(
        nats_url, routing=lambda m: subject, ack_timeout=timedelta(milliseconds=300)
    )
    try:
        result = await publisher.publish(outbox_rows(2))
    finally:
        await publisher.close()
    # Nothing can tell it from a JetStream that does not answer: the rows wait, unsettled, and
    # the outage the relay reports names the subject and both causes.
    assert result.acked == frozenset()
    assert not result.refused
    assert result.lost == (
        f"no acknowledgement from JetStream within 0.3 s for {subject!r}: JetStream is slow or "
        "unavailable, or no stream covers the subject and a subscriber that is not a stream "
        "took the message"
    )


async def test_a_subscriber_that_answers_beside_a_stream_leaves_the_pubacks_counted(
    nats_url: str, plain: Client
) -> None:
    stream = fresh("PGONCE_TEST_")
    subject = fresh("pgonce.both.")
    async with nats_stream(nats_url, stream, [subject]) as js:
        await plain.subscribe(subject, cb=answer)
        await plain.flush()
        publisher = NatsPublisher(nats_url, routing=lambda m: subject)
        try:
            result = await publisher.publish(outbox_rows(3))
        finally:
            await publisher.close()
        stored = await nats_read(js, stream)
    assert result.acked == {1, 2, 3}
    assert not result.refused
    assert [r.message_id for r in stored] == ["1", "2", "3"]


def attempts(dsn: str) -> list[tuple[int, str | None, bool]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            (n, error, published)
            for n, error, published in conn.execute(
                "SELECT attempts, last_error, published_at IS NOT NULL FROM pgonce.outbox "
                "ORDER BY id"
            ).fetchall()
        ]


async def test_a_stream_deleted_while_the_relay_runs_is_named_and_the_row_waits_for_it(
    direct_dsn: str, nats_url: str, plain: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce.relay")
    stream = fresh("PGONCE_TEST_")
    kind = fresh("order")
    subject = f"outbox.{kind}"
    js = plain.jetstream()
    relay = Relay(direct_dsn, NatsPublisher(nats_url), poll_interval=timedelta(milliseconds=50))
    try:
        await js.add_stream(name=stream, subjects=[subject])
        async with running(relay) as run:
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, kind, "1", "created", {"n": 1})
            await wait_until(lambda: relay.stats.published == 1)
            await js.delete_stream(stream)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, kind, "1", "created", {"n": 2})
            await wait_until(lambda: attempts(direct_dsn)[1][0] == 1)
            # A refusal, the subject named: an attempt counted, retried after its backoff.
            _, error, published = attempts(direct_dsn)[1]
            assert not published
            assert error == (
                f"JetStream refused the message: no stream covers the subject {subject!r}"
            )
            await js.add_stream(name=stream, subjects=[subject])
            await wait_until(lambda: relay.stats.published == 2)
            await run.stop_within(10, "the relay did not stop")
        stored = await nats_read(js, stream)
    finally:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(stream)
    # The second row alone, in the stream made again.
    assert [json.loads(r.body) for r in stored] == [{"n": 2}]
    lines = [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]
    assert any(f"no stream covers the subject {subject!r}" in line for line in lines), lines
