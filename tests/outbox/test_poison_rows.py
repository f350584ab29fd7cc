"""Rows a broker or endpoint can never take: each is refused on its own (an attempt counted,
parked in the end) and never stalls the relay's other rows, nor jumps ahead of its aggregate."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from redis.asyncio import Redis

from pgonce.core.outbox import OutboxMessage, RetryPolicy
from pgonce.errors import BrokerUnavailable, ConfigError
from pgonce.publishers.http import HttpPublisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import nats_read, nats_stream, rabbitmq_drain, rabbitmq_queue
from tests.outbox.conftest import Receiver, answers, free_port, fresh

#: One attempt: a refused row is parked at once, so that one drain shows where it ends.
PARK_AT_ONCE = RetryPolicy(max_attempts=1)
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def rows(dsn: str) -> dict[int, tuple[Any, ...]]:
    """Every outbox row by id: (published, parked, attempts, last_error)."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT id, published_at IS NOT NULL, parked_at IS NOT NULL, attempts, last_error"
            " FROM pgonce.outbox"
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in found}


async def one_batch(relay: Relay, dsn: str) -> None:
    """One batch, one transaction: what drain()'s concurrent loops would blur (one of them may
    take a row as soon as another one parked the row before it)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await relay.run_once(conn)


async def first_batch_then_drain(relay: Relay, dsn: str) -> dict[int, tuple[Any, ...]]:
    """The rows after one batch; then the rest drained and the publisher closed."""
    try:
        await one_batch(relay, dsn)
        after_first = rows(dsn)
        await relay.drain()
    finally:
        await relay.publisher.close()
    return after_first


async def test_a_payload_above_nats_max_payload_is_refused_and_the_rest_goes_on(
    dsn: str, nats_url: str
) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    with psycopg.connect(dsn) as conn:
        big = enqueue(conn, "order", "1", "e", "x" * (2 * 1024 * 1024))
        behind = enqueue(conn, "order", "1", "e", {"n": 2})
        other = enqueue(conn, "order", "2", "e", {"n": 3})
        conn.commit()
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]) as js:
        relay = Relay(
            dsn,
            NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}"),
            policy=PARK_AT_ONCE,
        )
        after_first = await first_batch_then_drain(relay, dsn)
        received = await nats_read(js, stream)
    # The big row is refused and parked, with a reason a person can act on; the other aggregate
    # was published in the same batch; the big row's successor waited for it to be settled.
    assert after_first[big][:3] == (False, True, 1)
    assert "max_payload" in after_first[big][3]
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert [int(r.message_id) for r in received] == [other, behind]


async def test_a_header_http_cannot_carry_is_refused_and_the_rest_goes_on(
    dsn: str, receiver: Receiver
) -> None:
    with psycopg.connect(dsn) as conn:
        bad = enqueue(conn, "order", "1", "e", {"n": 1}, headers={"x-note": "Zoë"})
        other = enqueue(conn, "order", "2", "e", {"n": 2})
        conn.commit()
    relay = Relay(dsn, HttpPublisher(url=receiver.url, secret=SECRET), policy=PARK_AT_ONCE)
    try:
        await relay.drain()
    finally:
        await relay.publisher.close()
    after = rows(dsn)
    assert after[bad][:3] == (False, True, 1)
    assert "UnicodeEncodeError" in after[bad][3]
    assert after[other][0] is True
    assert [h["webhook-id"] for h, _ in receiver.requests] == [str(other)]


async def test_a_routed_url_httpx_refuses_is_a_refusal_that_shows_no_credential(
    dsn: str,
) -> None:
    with psycopg.connect(dsn) as conn:
        row = enqueue(conn, "order", "1", "e", {"n": 1})
        conn.commit()
    publisher = HttpPublisher(routing=lambda m: "https://user:s3cret@[::1/hooks", secret=SECRET)
    relay = Relay(dsn, publisher, policy=PARK_AT_ONCE)
    try:
        await relay.drain()
    finally:
        await relay.publisher.close()
    published, parked, attempts, error = rows(dsn)[row]
    assert (published, parked, attempts) == (False, True, 1)
    assert "s3cret" not in error


def _webhooks(**options: Any) -> HttpPublisher:
    return HttpPublisher(secret=SECRET, **options)


@pytest.mark.parametrize(
    ("make", "options", "says"),
    [
        (_webhooks, {"url": "ftp://example.com/hooks"}, "http:// or https://"),
        (_webhooks, {"url": "https://user:s3cret@[::1/hooks"}, "http:// or https://"),
        (_webhooks, {"url": "example.com/hooks"}, "http:// or https://"),
        (_webhooks, {"url": "https://example.com/", "concurrency": 0}, "concurrency"),
        (_webhooks, {"url": "https://example.com/", "timeout": timedelta(0)}, "timeout"),
        (RedisStreamsPublisher, {"url": "http://user:s3cret@127.0.0.1:6379/0"}, "redis://"),
        (RedisStreamsPublisher, {"url": "127.0.0.1:6379"}, "redis://"),
        (RedisStreamsPublisher, {"maxlen": 0}, "maxlen"),
        (RedisStreamsPublisher, {"maxlen": -1}, "maxlen"),
        (RedisStreamsPublisher, {"timeout": timedelta(0)}, "timeout"),
        (RabbitMQPublisher, {"url": "amqp://relay:s3cret@127.0.0.1:notaport/"}, "amqp://"),
        (RabbitMQPublisher, {"url": "redis://relay:s3cret@127.0.0.1:6379/"}, "amqp://"),
        (RabbitMQPublisher, {"exchange_type": "fan-out"}, "exchange_type must be one of"),
        (RabbitMQPublisher, {"max_message_size": 0}, "max_message_size must be a whole"),
        (RabbitMQPublisher, {"max_message_size": 1.5e6}, "max_message_size must be a whole"),
    ],
)
def test_a_publisher_that_cannot_work_is_a_config_error(
    make: Callable[..., object], options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        make(**options)
    assert "s3cret" not in str(raised.value)


async def test_a_redis_that_stops_answering_leaves_the_batch_unsettled_in_bounded_time() -> None:
    # A listening socket that never accepts: the kernel completes the handshake, nothing answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        publisher = RedisStreamsPublisher(
            f"redis://127.0.0.1:{port}/0", timeout=timedelta(milliseconds=300)
        )
        message = OutboxMessage(1, "order", "1", "e", "{}", {}, datetime.now(UTC), 0)
        try:
            with pytest.raises(BrokerUnavailable):
                await asyncio.wait_for(publisher.publish([message]), timeout=10)
        finally:
            await publisher.close()


async def test_headers_above_an_amqp_frame_are_refused_and_the_rest_goes_on(
    dsn: str, rabbitmq_url: str
) -> None:
    queue_name = fresh("pgonce-test-")
    with psycopg.connect(dsn) as conn:
        before = enqueue(conn, queue_name, "2", "e", {"n": 0})
        big = enqueue(conn, queue_name, "1", "e", {"n": 1}, headers={"note": "x" * 200_000})
        behind = enqueue(conn, queue_name, "1", "e", {"n": 2})
        other = enqueue(conn, queue_name, "3", "e", {"n": 3})
        conn.commit()
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        relay = Relay(dsn, RabbitMQPublisher(rabbitmq_url), policy=PARK_AT_ONCE)
        after_first = await first_batch_then_drain(relay, dsn)
        received = await rabbitmq_drain(queue)
    # Sent, the big header would have closed the connection and taken the batch's confirms
    # with it, again at every batch.
    assert after_first[big][:3] == (False, True, 1)
    assert "frame" in after_first[big][3]
    assert after_first[before][0] is True
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert sorted(int(r.message_id) for r in received) == [before, behind, other]


async def test_a_routing_key_above_255_bytes_is_refused_not_lost(rabbitmq_url: str) -> None:
    publisher = RabbitMQPublisher(rabbitmq_url, routing=lambda m: "é" * 200)
    message = OutboxMessage(1, "order", "1", "e", "{}", {}, datetime.now(UTC), 0)
    try:
        result = await publisher.publish([message])
    finally:
        await publisher.close()
    assert result.lost is None
    assert "routing key of 400 bytes" in result.refused[1]


@pytest.mark.parametrize(
    ("aggregatetype", "headers", "says"),
    [
        ("order created", {}, "invalid subject"),
        ("order\r\nPUB x 1", {}, "invalid subject"),
        ("order", {"a: b": "c"}, "invalid header"),
    ],
)
async def test_what_the_nats_client_cannot_send_is_refused_not_lost(
    nats_url: str, aggregatetype: str, headers: dict[str, str], says: str
) -> None:
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]):
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        now = datetime.now(UTC)
        bad = OutboxMessage(1, aggregatetype, "1", "e", "{}", headers, now, 0)
        behind = OutboxMessage(2, aggregatetype, "1", "e", "{}", {}, now, 0)
        other = OutboxMessage(3, "order", "2", "e", "{}", {}, now, 0)
        try:
            result = await publisher.publish([bad, behind, other])
        finally:
            await publisher.close()
    assert result.lost is None
    assert says in result.refused[1]
    assert result.refused.keys() == {1}
    assert result.acked == {3}


@pytest.mark.parametrize(
    ("payload_bytes", "headers"),
    [(100, {"note": "x" * 2 * 1024 * 1024}), (1024 * 1024 - 50, {})],
)
async def test_headers_that_take_a_message_above_max_payload_are_refused_not_lost(
    nats_url: str, payload_bytes: int, headers: dict[str, str]
) -> None:
    # The client checks only the payload; the server counts the headers too, and closes the
    # connection for a message above max_payload, with every other answer of the batch.
    stream = fresh("PGONCE_TEST_")
    prefix = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [f"{prefix}.>"]):
        publisher = NatsPublisher(nats_url, routing=lambda m: f"{prefix}.{m.aggregatetype}")
        now = datetime.now(UTC)
        payload = '"' + "y" * (payload_bytes - 2) + '"'
        big = OutboxMessage(1, "order", "1", "e", payload, headers, now, 0)
        other = OutboxMessage(2, "order", "2", "e", "{}", {}, now, 0)
        try:
            result = await publisher.publish([big, other])
        finally:
            await publisher.close()
    assert result.lost is None
    assert "max_payload" in result.refused[1]
    assert result.acked == {2}


async def test_a_webhook_endpoint_that_trickles_its_answer_is_cut_off_at_the_timeout() -> None:
    # One byte of the status line every 50 ms: every read is quick, the answer never ends.
    finished = asyncio.Event()

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not finished.is_set():
                writer.write(b"H")
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    publisher = HttpPublisher(
        url=f"http://127.0.0.1:{port}/hooks", secret=SECRET, timeout=timedelta(milliseconds=500)
    )
    message = OutboxMessage(1, "order", "1", "e", "{}", {}, datetime.now(UTC), 0)
    try:
        result = await asyncio.wait_for(publisher.publish([message]), timeout=10)
    finally:
        finished.set()
        await publisher.close()
        server.close()
        await server.wait_closed()
    assert "no answer within 0.5 s" in result.refused[1]


def test_a_broker_wait_of_nothing_is_a_config_error() -> None:
    # Every batch would end unsettled at once, and be retried for ever.
    with pytest.raises(ConfigError, match="ack_timeout"):
        NatsPublisher(ack_timeout=timedelta(0))
    with pytest.raises(ConfigError, match="confirm_timeout"):
        RabbitMQPublisher(confirm_timeout=timedelta(seconds=-1))


async def test_an_amqp_header_name_above_128_bytes_is_refused_not_cut(rabbitmq_url: str) -> None:
    # Cut to 128 bytes, two such names would arrive as one, with one of the two values.
    queue_name = fresh("pgonce-test-")
    now = datetime.now(UTC)
    long = {"x" * 130 + "a": "1", "x" * 130 + "b": "2"}
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        publisher = RabbitMQPublisher(rabbitmq_url)
        try:
            result = await publisher.publish(
                [
                    OutboxMessage(1, queue_name, "1", "e", "{}", long, now, 0),
                    OutboxMessage(2, queue_name, "2", "e", "{}", {}, now, 0),
                ]
            )
        finally:
            await publisher.close()
        received = await rabbitmq_drain(queue)
    assert "128 bytes" in result.refused[1]
    assert result.acked == {2}
    assert [r.message_id for r in received] == ["2"]


@pytest.fixture
def own_redis(tmp_path: Any) -> Iterator[str]:
    """A Redis server of this test's own (its settings are changed), on a free port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            if answers("127.0.0.1", port, timeout=0.05):
                break
            server.poll()
            assert server.returncode is None, "redis-server exited"
            threading.Event().wait(0.025)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize(
    "state",
    [
        ["CONFIG", "SET", "maxmemory", "1"],
        ["REPLICAOF", "127.0.0.1", "1"],
    ],
)
async def test_a_redis_that_cannot_take_writes_leaves_rows_waiting_not_refused(
    dsn: str, own_redis: str, state: list[str]
) -> None:
    # Out of memory, or a primary demoted to a replica by a failover: counted as refusals, every
    # row of the backlog would be parked within the half hour.
    client = Redis.from_url(own_redis)
    try:
        await client.execute_command(*state)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()
    with psycopg.connect(dsn) as conn:
        row = enqueue(conn, "order", "1", "e", {"n": 1})
        conn.commit()
    relay = Relay(dsn, RedisStreamsPublisher(own_redis), policy=PARK_AT_ONCE)
    try:
        stats = await relay.drain()
    finally:
        await relay.publisher.close()
    assert stats.unsettled >= 1
    assert (stats.published, stats.refused, stats.parked) == (0, 0, 0)
    assert rows(dsn)[row] == (False, False, 0, None)


class RawReceiver:
    """An HTTP/1.1 endpoint on a raw socket, answering every request on a kept-alive connection
    with ``head`` and then ``body`` (bytes, or a callable that streams for ever)."""

    def __init__(self, head: bytes, endless_body: bool = False) -> None:
        self.head = head
        self.endless_body = endless_body
        self.connections = 0
        self.requests = 0
        self.done = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while not self.done.is_set():
                header = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in header.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                writer.write(self.head)
                await writer.drain()
                while self.endless_body and not self.done.is_set():
                    writer.write(b"x" * 65536)
                    await writer.drain()
                    await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def send_through(receiver: RawReceiver, batch: list[OutboxMessage]) -> Any:
    server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    publisher = HttpPublisher(
        url=f"http://127.0.0.1:{port}/hooks", secret=SECRET, timeout=timedelta(seconds=2)
    )
    try:
        return await asyncio.wait_for(publisher.publish(batch), timeout=20)
    finally:
        receiver.done.set()
        await publisher.close()
        server.close()
        await server.wait_closed()


def one_aggregate(count: int) -> list[OutboxMessage]:
    now = datetime.now(UTC)
    return [OutboxMessage(n, "order", "1", "e", "{}", {}, now, 0) for n in range(1, count + 1)]


async def test_webhooks_of_one_aggregate_reuse_one_connection() -> None:
    receiver = RawReceiver(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    result = await send_through(receiver, one_aggregate(3))
    assert result.acked == {1, 2, 3}
    assert (receiver.requests, receiver.connections) == (3, 1)


async def test_a_2xx_with_an_endless_body_is_acknowledged_in_bounded_time() -> None:
    # The status decides; the body is read only to a bound, and never kept.
    receiver = RawReceiver(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", True)
    result = await send_through(receiver, one_aggregate(1))
    assert result.acked == {1}
