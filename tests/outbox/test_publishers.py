"""Each publisher against its real broker: acks, refusals, the message id on the wire."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable
from pgonce.publishers.http import HttpPublisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.webhooks.schemes.standard_webhooks import StandardWebhooks
from tests.outbox.brokers import (
    nats_read,
    nats_stream,
    rabbitmq_drain,
    rabbitmq_queue,
    redis_delete,
    redis_read,
)
from tests.outbox.conftest import Receiver, free_port, fresh

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def batch(aggregatetype: str, count: int = 5, aggregates: int = 2) -> list[OutboxMessage]:
    return [
        OutboxMessage(
            id=1000 + n,
            aggregatetype=aggregatetype,
            aggregateid=str(n % aggregates),
            type="order.created",
            payload_json=json.dumps({"n": n, "name": "Zoë"}),
            headers={"tenant": "t1"},
            created_at=NOW,
            attempts=0,
        )
        for n in range(count)
    ]


async def test_rabbitmq_acknowledges_with_confirms_and_carries_the_outbox_id(
    rabbitmq_url: str,
) -> None:
    name = fresh("pgonce-test-")
    async with rabbitmq_queue(rabbitmq_url, name) as queue:
        publisher = RabbitMQPublisher(rabbitmq_url)
        try:
            messages = batch(name)
            result = await publisher.publish(messages)
        finally:
            await publisher.close()
        assert result.acked == {m.id for m in messages}
        assert result.refused == {}
        received = await rabbitmq_drain(queue)
    assert [r.message_id for r in received] == [str(m.id) for m in messages]
    assert received[0].payload == {"n": 0, "name": "Zoë"}


async def test_rabbitmq_refuses_an_unroutable_message(rabbitmq_url: str) -> None:
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        result = await publisher.publish(batch(fresh("pgonce-nowhere-"), count=2))
    finally:
        await publisher.close()
    assert result.acked == frozenset()
    assert set(result.refused) == {1000, 1001}
    assert "unroutable" in result.refused[1000]


async def test_rabbitmq_that_does_not_answer_is_unavailable() -> None:
    publisher = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{free_port()}/")
    with pytest.raises(BrokerUnavailable):
        await publisher.publish(batch("order"))


async def test_nats_jetstream_dedupes_a_republished_batch_by_msg_id(nats_url: str) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        try:
            messages = batch("order")
            first = await publisher.publish(messages)
            # A relay that died before marking publishes the same rows again.
            again = await publisher.publish(messages)
        finally:
            await publisher.close()
        assert first.acked == again.acked == {m.id for m in messages}
        stored = await nats_read(js, stream)
    assert [r.message_id for r in stored] == [str(m.id) for m in messages]


async def test_nats_refuses_a_subject_no_stream_covers(nats_url: str) -> None:
    publisher = NatsPublisher(nats_url, routing=lambda m: fresh("pgonce.nostream."))
    try:
        result = await publisher.publish(batch("order", count=2))
    finally:
        await publisher.close()
    assert result.acked == frozenset()
    assert set(result.refused) == {1000, 1001}


async def test_nats_refuses_what_a_full_stream_rejects_and_acks_the_rest(nats_url: str) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [f"{prefix}.>"], max_msgs=3):
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        try:
            result = await publisher.publish(batch("order"))
        finally:
            await publisher.close()
    assert result.acked == {1000, 1001, 1002}
    assert set(result.refused) == {1003, 1004}
    assert all("maximum messages exceeded" in reason for reason in result.refused.values())


async def test_nats_acks_into_a_stream_whose_name_is_error(nats_url: str) -> None:
    # A PubAck names its stream; a stream called "error" must not read as an error answer.
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, "error", [f"{prefix}.>"]):
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        try:
            result = await publisher.publish(batch("order"))
        finally:
            await publisher.close()
    assert result.acked == {m.id for m in batch("order")}
    assert result.refused == {}


async def test_nats_batches_in_flight_at_once_each_get_their_own_acks(nats_url: str) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        batches = [
            [m._replace(id=m.id + 100 * n) for m in batch("order", count=50)] for n in range(4)
        ]
        try:
            results = await asyncio.gather(*(publisher.publish(b) for b in batches))
        finally:
            await publisher.close()
        stored = await nats_read(js, stream)
    for sent, result in zip(batches, results, strict=True):
        assert result.acked == {m.id for m in sent}
    assert len(stored) == 200


async def test_nats_that_does_not_answer_is_unavailable() -> None:
    publisher = NatsPublisher(f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(BrokerUnavailable):
        await publisher.publish(batch("order"))


async def test_redis_streams_appends_with_the_outbox_id(redis_url: str) -> None:
    key = fresh("pgonce-test-")
    publisher = RedisStreamsPublisher(redis_url, routing=lambda m: key)
    try:
        messages = batch("order")
        result = await publisher.publish(messages)
        assert result.acked == {m.id for m in messages}
        received = await redis_read(redis_url, key)
    finally:
        await publisher.close()
        await redis_delete(redis_url, key)
    assert [r.message_id for r in received] == [str(m.id) for m in messages]
    assert [r.aggregateid for r in received] == ["0", "1", "0", "1", "0"]


async def test_redis_refuses_an_xadd_on_a_key_of_another_type(redis_url: str) -> None:
    key = fresh("pgonce-test-")
    publisher = RedisStreamsPublisher(redis_url, routing=lambda m: key)
    await redis_delete(redis_url, key)
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    try:
        await client.set(key, "not a stream")
        result = await publisher.publish(batch("order", count=2))
    finally:
        await client.delete(key)
        await client.aclose()
        await publisher.close()
    assert result.acked == frozenset()
    assert "WRONGTYPE" in result.refused[1000]


async def test_webhooks_are_signed_per_standard_webhooks_with_the_outbox_id(
    receiver: Receiver,
) -> None:
    # The reference library checks the timestamp against the real clock, so this one uses it.
    publisher = HttpPublisher(url=receiver.url, secret=SECRET)
    try:
        messages = batch("order", count=3)
        result = await publisher.publish(messages)
    finally:
        await publisher.close()
    assert result.acked == {m.id for m in messages}
    assert sorted(h["webhook-id"] for h, _ in receiver.requests) == [str(m.id) for m in messages]
    for headers, body in receiver.requests:
        # The reference library and pgonce's own verifier both accept the signature.
        envelope = json.loads(body)
        assert Webhook(SECRET).verify(body, headers) == envelope
        StandardWebhooks([SECRET]).verify(headers, body, now=datetime.now(UTC))
        assert envelope["type"] == "order.created"
        assert headers["tenant"] == "t1"


async def test_a_refused_webhook_stops_its_aggregate_but_not_the_others(
    receiver: Receiver,
) -> None:
    # The first delivery of aggregate "0" fails; aggregate "1" is unaffected.
    receiver.status = lambda _n: 204
    failing = {"1000"}

    def status_for(_count: int) -> int:
        last_id = receiver.requests[-1][0]["webhook-id"]
        return 503 if last_id in failing else 204

    receiver.status = status_for
    publisher = HttpPublisher(url=receiver.url, secret=SECRET, clock=lambda: NOW)
    try:
        result = await publisher.publish(batch("order", count=6))
    finally:
        await publisher.close()
    # Aggregate "0" holds 1000, 1002, 1004: 1000 is refused, the two behind it are not sent.
    assert result.refused.keys() == {1000}
    assert "503" in result.refused[1000]
    assert result.acked == {1001, 1003, 1005}
    assert {h["webhook-id"] for h, _ in receiver.requests} == {"1000", "1001", "1003", "1005"}


async def test_an_unreachable_webhook_endpoint_is_a_refusal() -> None:
    url = f"http://127.0.0.1:{free_port()}/hooks"
    publisher = HttpPublisher(url=url, secret=SECRET)
    try:
        result = await publisher.publish(batch("order", count=1))
    finally:
        await publisher.close()
    assert "failed" in result.refused[1000]
    assert "/hooks" not in result.refused[1000]
