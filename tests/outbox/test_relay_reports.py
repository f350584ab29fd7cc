"""The relay says what goes wrong as it goes wrong: on a real RabbitMQ exchange with nothing bound,
each refusal is logged with its aggregate, the broker's reason and the next step, once per kind
(then held back), counted by reason in /metrics, and a missing queue is reported before the first
message goes out."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import aio_pika
import psycopg
import pytest

from pgonce.core.outbox import RetryPolicy
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.relay import Relay
from pgonce.service.metrics import ServiceMetrics
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import fresh, wait_until


def fill(dsn: str, aggregatetype: str, count: int) -> None:
    with psycopg.connect(dsn) as conn:
        for n in range(count):
            enqueue(conn, aggregatetype, str(n), "created", {"n": n})
        conn.commit()


async def exchange_with_nothing_bound(url: str) -> str:
    name = fresh("pgonce-unbound-")
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=False)
    return name


async def delete_exchange(url: str, name: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.exchange_delete(name)


def relay_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]


async def test_unroutable_rows_are_logged_once_per_kind_counted_and_parked_loudly(
    dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    exchange = await exchange_with_nothing_bound(rabbitmq_url)
    fill(dsn, "invoice", 3)
    publisher = RabbitMQPublisher(rabbitmq_url, exchange=exchange)
    relay = Relay(dsn, publisher, policy=RetryPolicy(max_attempts=2))
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    start = datetime(2030, 1, 1, tzinfo=UTC)
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            first = await relay.run_once(conn, now=start)
            lines = relay_lines(caplog)
            refusals = [line for line in lines if "unroutable outbox row" in line]
            # Three rows of three aggregates refused at once: one line, not three.
            assert first.refused == 3
            assert len(refusals) == 1, lines
            assert f"on exchange '{exchange}': no queue is bound for it" in refusals[0]
            assert "(aggregate invoice/" in refusals[0]
            assert "attempt 1 of 2, retry at 2030-01-01 00:00:" in refusals[0]
            assert any(f"publishing to the exchange '{exchange}'" in line for line in lines)

            caplog.clear()
            second = await relay.run_once(conn, now=start + timedelta(minutes=5))
            parked = [line for line in relay_lines(caplog) if "parked after" in line]
            assert second.parked == 3
            assert len(parked) == 1
            assert "replay it with `pgonce replay --outbox --id" in parked[0]
    finally:
        await publisher.close()
        await delete_exchange(rabbitmq_url, exchange)

    assert relay.stats.failures == {"unroutable": 6}
    metrics = ServiceMetrics(relay_stats=lambda: [relay.stats]).render().decode()
    assert 'pgonce_relay_failures_total{reason="unroutable"} 6.0' in metrics


async def test_a_missing_queue_on_the_default_exchange_is_reported_before_publishing(
    dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    aggregatetype = fresh("pgonce-noqueue-")
    fill(dsn, aggregatetype, 2)
    publisher = RabbitMQPublisher(rabbitmq_url)
    relay = Relay(dsn, publisher)
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await relay.run_once(conn)
    finally:
        await publisher.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"no queue named '{aggregatetype}'" in w and "set [outbox] declare = true" in w
        for w in warnings
    ), warnings


async def test_declare_creates_the_queue_so_the_rows_are_published(
    dsn: str, rabbitmq_url: str
) -> None:
    aggregatetype = fresh("pgonce-declared-")
    fill(dsn, aggregatetype, 2)
    publisher = RabbitMQPublisher(rabbitmq_url, declare=True)
    relay = Relay(dsn, publisher)
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            report = await relay.run_once(conn)
        assert report.published == 2
    finally:
        await publisher.close()
        connection = await aio_pika.connect(rabbitmq_url)
        async with connection:
            await (await connection.channel()).queue_delete(aggregatetype)


async def test_a_named_exchange_that_does_not_exist_says_what_to_do(
    dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    fill(dsn, "invoice", 1)
    publisher = RabbitMQPublisher(rabbitmq_url, exchange=fresh("pgonce-missing-"))
    relay = Relay(dsn, publisher)
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            report = await relay.run_once(conn)
    finally:
        await publisher.close()
    assert report.broker_down
    assert relay.stats.failures == {"unavailable": 1}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]
    assert "RabbitMQ has no exchange named 'pgonce-missing-" in line
    assert "declare it, or set [outbox] declare = true" in line
    assert "they wait without an attempt counted" in line


async def test_a_missing_exchange_is_said_at_the_relays_start_before_any_row(
    dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    relay = Relay(dsn, RabbitMQPublisher(rabbitmq_url, exchange=fresh("pgonce-missing-")))
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(
            lambda: any("the rows wait until it is fixed" in m for m in relay_lines(caplog))
        )
    finally:
        stop.set()
        await running
    lines = relay_lines(caplog)
    assert any("publishing the outbox of schema pgonce through rabbitmq" in m for m in lines)
    assert any("RabbitMQ has no exchange named 'pgonce-missing-" in m for m in lines)
