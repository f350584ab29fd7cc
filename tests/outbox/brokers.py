"""Broker-side helpers for the tests: fresh destinations, and reading back what arrived.

Reading back is how the tests count message ids on the broker's side, never on the relay's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import nats
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from redis.asyncio import Redis


@dataclass(frozen=True)
class Received:
    """One message as a broker holds it: the message id (the outbox id), the aggregate id, the
    body, and the id the broker deduplicates by where it is another (JetStream's
    ``Nats-Msg-Id``, which names the outbox too)."""

    message_id: str
    aggregateid: str
    body: bytes
    dedupe_id: str = ""

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


@contextlib.asynccontextmanager
async def rabbitmq_queue(url: str, name: str) -> AsyncIterator[aio_pika.abc.AbstractQueue]:
    """A fresh queue (non-durable, deleted afterwards) on the default exchange."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, durable=False, auto_delete=False)
        try:
            yield queue
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def rabbitmq_drain(queue: aio_pika.abc.AbstractQueue) -> list[Received]:
    """Every message now in ``queue``, in queue order, consumed (removed)."""
    channel = queue.channel
    declared = await channel.declare_queue(queue.name, passive=True)
    expected = declared.declaration_result.message_count or 0
    out: list[Received] = []
    if not expected:
        return out
    done = asyncio.Event()

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        out.append(Received(str(message.message_id), str(headers.get("aggregateid")), message.body))
        if len(out) >= expected:
            done.set()

    tag = await queue.consume(take, no_ack=True)
    try:
        await asyncio.wait_for(done.wait(), timeout=60)
    finally:
        await queue.cancel(tag)
    return out


@contextlib.asynccontextmanager
async def nats_stream(
    url: str, name: str, subjects: list[str], *, max_msgs: int = -1
) -> AsyncIterator[Any]:
    """A fresh JetStream stream in memory, deleted afterwards; yields the JetStream context.

    With ``max_msgs``, the stream refuses messages beyond that many (discard policy "new")."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=subjects,
                storage=StorageType.MEMORY,
                max_msgs=max_msgs,
                discard=DiscardPolicy.NEW,
            )
        )
        try:
            yield js
        finally:
            await js.delete_stream(name)
    finally:
        await client.close()


async def nats_read(js: Any, stream: str) -> list[Received]:
    """Every message stored in ``stream``, in stream order: the outbox id from the
    ``message-id`` header, ``Nats-Msg-Id`` as the ``dedupe_id``."""
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        msg = await js.get_msg(stream, seq)
        headers = msg.headers or {}
        out.append(
            Received(
                headers["message-id"],
                headers.get("aggregateid", ""),
                msg.data or b"",
                headers["Nats-Msg-Id"],
            )
        )
    return out


async def redis_read(url: str, key: str) -> list[Received]:
    """Every entry of the stream ``key``, in stream order."""
    client = Redis.from_url(url)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await client.xrange(key)  # type: ignore[assignment]
    finally:
        await client.aclose()
    return [
        Received(f[b"message-id"].decode(), f[b"aggregateid"].decode(), f[b"payload"])
        for _entry_id, f in entries
    ]


async def redis_delete(url: str, *keys: str) -> None:
    client = Redis.from_url(url)
    try:
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
