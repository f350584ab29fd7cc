"""A handler that forwards each inbox event to an internal HTTP endpoint.

The event's raw body is POSTed with its content type, ``Idempotency-Key: <event id>`` and
``Pgonce-Source: <source>``. An event id that cannot be an Idempotency-Key as it is (the inbox
takes up to 512 bytes of any text; a key is at most 255 visible ASCII characters, and a leading
``"`` would start a quoted one) is sent as ``pgonce-sha256:<hex>``, the SHA-256 of its UTF-8
bytes: the same event gets the same key at every retry. A 2xx answer marks the event done (in the
worker's transaction); anything else, or no answer, raises :class:`~pgonce.errors.ForwardFailed`
and the event is retried with backoff.

Delivery to the target is **at least once**, not exactly once: the target may have applied the
event when the worker dies, or the commit fails, after the target answered; the retry then
forwards it again. The target must therefore deduplicate by ``Idempotency-Key`` -- for example with
pgonce's own Idempotency-Key middleware, which turns the repeat into a replay of its first answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection

from pgonce.core.inbox import InboxEvent
from pgonce.errors import ForwardFailed
from pgonce.extras import needs
from pgonce.http.keys import MAX_KEY_LENGTH
from pgonce.publishers.base import short_error, url_origin
from pgonce.webhooks.source import Handler

with needs("http", "forwarding inbox events over HTTP"):
    import httpx

#: A forward that has not been answered after this many seconds failed; it stays below the default
#: handler timeout so that the error says "the target was slow", not "the handler hung".
DEFAULT_FORWARD_TIMEOUT = 10.0


def forward_to(
    url: str,
    *,
    client: httpx.AsyncClient | None = None,
    timeout: float = DEFAULT_FORWARD_TIMEOUT,
    headers: Iterable[tuple[str, str]] = (),
) -> Handler:
    """A handler that POSTs each event to ``url``; see the module docstring for the guarantee.

    ``client`` lets the caller share a connection pool (and its TLS settings) between forwards; by
    default one client is created for this handler and reused.
    """
    extra = list(headers)
    target = url_origin(url)  # what the event's last_error and the log show of the URL
    shared = client or httpx.AsyncClient(timeout=timeout)

    async def forward(event: InboxEvent, conn: AsyncConnection[Any]) -> None:
        request_headers = [
            ("content-type", event.headers.get("content-type", "application/octet-stream")),
            ("idempotency-key", idempotency_key(event.id)),
            ("pgonce-source", event.source),
            *extra,
        ]
        try:
            response = await shared.post(url, content=event.body, headers=request_headers)
        except httpx.HTTPError as error:
            raise ForwardFailed(f"forwarding to {target} failed: {short_error(error)}") from error
        if not response.is_success:
            raise ForwardFailed(f"forwarding to {target} was answered {response.status_code}")

    return forward


def idempotency_key(event_id: str) -> str:
    """The Idempotency-Key a forward of the event ``event_id`` carries: the id itself when it
    can be one as it is, else ``pgonce-sha256:`` and the hex SHA-256 of its UTF-8 bytes.

    The id itself was sent before, whatever it was: one with a character beyond ASCII failed
    every forward (and every retry) with a ``UnicodeEncodeError`` before anything was sent, one
    longer than a key may be was refused by the target at every retry, and the event ended as a
    dead letter, never forwarded.
    """
    if (
        len(event_id) <= MAX_KEY_LENGTH
        and event_id.isascii()
        and event_id.isprintable()
        and event_id == event_id.strip(" ")
        and not event_id.startswith('"')
    ):
        return event_id
    return "pgonce-sha256:" + hashlib.sha256(event_id.encode("utf-8")).hexdigest()
