"""NATS JetStream publisher (nats-py), deduplicated by ``Nats-Msg-Id``.

Each message carries the outbox id in ``Nats-Msg-Id``: JetStream drops a second message with the
same id inside the stream's duplicate window (2 minutes by default), so a relay that published a
batch and died before marking it does not even create a duplicate on the stream when the next relay
publishes again within the window. A batch is pipelined on one connection (the stream stores it in
order) and a message counts as acknowledged when its PubAck arrived (a PubAck flagged
``duplicate`` is an acknowledgement too: the stream has the message). An error answer (no stream
for the subject, a stream limit) is a refusal; a timeout or a lost connection leaves the message
unsettled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    body,
    by_aggregatetype,
    message_headers,
    short_error,
)

#: The machine's NATS server in development; in production this comes from configuration.
DEFAULT_SERVERS = "nats://127.0.0.1:4222"
#: How long a batch waits for its PubAcks; a healthy server answers in milliseconds.
DEFAULT_ACK_TIMEOUT = timedelta(seconds=10)
log = logging.getLogger("pgonce.publishers.nats")

#: JetStream's header for publish deduplication.
MSG_ID_HEADER = "Nats-Msg-Id"


class NatsPublisher:
    """Publishes to subject ``routing(message)`` (default ``outbox.<aggregatetype>``); a stream
    must cover the subjects (the publisher does not create streams: their limits are an operator's
    decision)."""

    name = "nats"

    def __init__(
        self,
        servers: str | list[str] = DEFAULT_SERVERS,
        *,
        routing: Routing | None = None,
        ack_timeout: timedelta = DEFAULT_ACK_TIMEOUT,
    ) -> None:
        self.servers = servers
        self.routing = routing or by_aggregatetype("outbox.")
        self.ack_timeout = ack_timeout
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self) -> JetStreamContext:
        # The relay's concurrent batch loops share this publisher: one of them connects.
        async with self._connecting:
            return await self._connect_once()

    async def _connect_once(self) -> JetStreamContext:
        if self._js is not None and self._client is not None and self._client.is_connected:
            return self._js
        await self.close()
        try:
            # No background reconnect: a lost connection must surface as unsettled messages now,
            # and the next batch connects afresh.
            # (max_reconnect_attempts=0 would make the first connect retry forever.)
            self._client = await nats.connect(
                self.servers,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                connect_timeout=5,
                error_cb=_log_error,
            )
        except (OSError, TimeoutError, nats.errors.Error) as error:
            await self.close()
            raise BrokerUnavailable(f"NATS: {short_error(error)}") from error
        self._js = self._client.jetstream()
        return self._js

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        js = await self._connect()
        acked: set[int] = set()
        refused: dict[int, str] = {}
        lost = False
        futures: list[asyncio.Future[Any]] = []
        try:
            for message in batch:
                headers = message_headers(message)
                headers[MSG_ID_HEADER] = message.message_id
                futures.append(
                    await js.publish_async(self.routing(message), body(message), headers=headers)
                )
        except (OSError, nats.errors.Error):
            # The connection broke mid-batch: what was not sent is unsettled.
            lost = True
        if futures:
            await asyncio.wait(futures, timeout=self.ack_timeout.total_seconds())
        for message, future in zip(batch, futures, strict=False):
            if not future.done() or future.cancelled():
                future.cancel()
                lost = True
                continue
            error = future.exception()
            if error is None:
                acked.add(message.id)
            elif isinstance(error, nats.js.errors.Error):
                refused[message.id] = f"JetStream refused the message: {error}"
            else:
                lost = True
        if lost:
            await self.close()
        return PublishResult(frozenset(acked), refused)

    async def close(self) -> None:
        client, self._client, self._js = self._client, None, None
        if client is not None and not client.is_closed:
            # Closing a broken connection may fail; it is gone either way.
            with contextlib.suppress(Exception):
                await client.close()


async def _log_error(error: Exception) -> None:
    # nats-py reports connection errors here as well as raising them; the relay already logs
    # the raised one, so this is detail for debugging only.
    log.debug("NATS client error: %s", error)
