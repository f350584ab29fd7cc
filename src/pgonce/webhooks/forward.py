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
import re
from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection

from pgonce.core.checks import describe
from pgonce.core.inbox import InboxEvent
from pgonce.errors import ConfigError, ForwardFailed
from pgonce.extras import needs
from pgonce.http.keys import MAX_KEY_LENGTH
from pgonce.publishers.base import short_error, url_origin
from pgonce.webhooks.source import Handler

with needs("http", "forwarding inbox events over HTTP"):
    import httpx

#: A forward that has not been answered after this many seconds failed; it stays below the default
#: handler timeout so that the error says "the target was slow", not "the handler hung".
DEFAULT_FORWARD_TIMEOUT = 10.0

#: An HTTP header name (RFC 9110's token).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", re.ASCII)

#: The Content-Type of a forward whose delivery came without one.
_OCTETS = "application/octet-stream"


def forward_to(
    url: str,
    *,
    client: httpx.AsyncClient | None = None,
    timeout: float = DEFAULT_FORWARD_TIMEOUT,
    headers: Iterable[tuple[str, str]] = (),
) -> Handler:
    """A handler that POSTs each event to ``url``; see the module docstring for the guarantee.

    ``client`` lets the caller share a connection pool (and its TLS settings) between forwards; by
    default one client is created for this handler and reused. A ``url`` that is not http(s) with
    a host, or a header httpx cannot send, is a :class:`~pgonce.errors.ConfigError` here.
    """
    target = _checked_url(url)  # what the event's last_error and the log show of the URL
    extra = _checked_headers(headers)
    shared = client or httpx.AsyncClient(timeout=timeout)

    async def forward(event: InboxEvent, conn: AsyncConnection[Any]) -> None:
        request_headers = [
            (b"content-type", _sent_bytes(event.headers.get("content-type", _OCTETS))),
            (b"idempotency-key", idempotency_key(event.id).encode("ascii")),
            (b"pgonce-source", event.source.encode("ascii")),
            *extra,
        ]
        try:
            response = await shared.post(url, content=event.body, headers=request_headers)
        except httpx.HTTPError as error:
            raise ForwardFailed(f"forwarding to {target} failed: {short_error(error)}") from error
        if not response.is_success:
            raise ForwardFailed(f"forwarding to {target} was answered {response.status_code}")

    return forward


def _checked_url(url: object) -> str:
    """The origin of ``url`` (what errors show of it), or :class:`ConfigError` unless it is an
    http(s) URL with a host. Such a URL was taken, and every forward then failed (httpx's
    ``UnsupportedProtocol``) at each retry until the event was dead-lettered."""
    if not isinstance(url, str):
        raise ConfigError(f"the forward target must be a URL string, not {describe(url)}")
    origin = url_origin(url)
    if not origin.startswith(("http://", "https://")):
        raise ConfigError(
            f"the forward target must be an http:// or https:// URL with a host, not {origin}"
        )
    return origin


def _checked_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """The extra headers of every forward, or :class:`ConfigError` unless each is a (name, value)
    pair of text httpx can send (a token name, an ASCII value without line breaks). One it cannot
    was taken, and every forward then failed before anything was sent, at each retry."""
    if isinstance(headers, str | bytes) or not isinstance(headers, Iterable):
        raise ConfigError(
            f"the forward's headers must be (name, value) pairs, not {describe(headers)}"
        )
    checked = []
    for number, pair in enumerate(headers, 1):
        text = isinstance(pair, tuple) and all(isinstance(part, str) for part in pair)
        if not (text and len(pair) == 2):
            raise ConfigError(f"forward header #{number} must be a (name, value) pair of str")
        name, value = pair
        if not _TOKEN.fullmatch(name):
            raise ConfigError(f"forward header #{number} does not have a valid header name")
        if not (value.isascii() and value.isprintable()):
            raise ConfigError(
                f"forward header #{number} ({name}) must have a printable ASCII value"
            )
        checked.append((name.encode("ascii"), value.encode("ascii")))
    return checked


def _sent_bytes(value: str) -> bytes:
    """A stored header value as the bytes it arrived as: the receiver reads them as Latin-1, which
    maps every byte to one character. As text, httpx encodes it as ASCII, and a Content-Type with
    a byte beyond ASCII (a Latin-1 charset or name parameter) failed every forward, and every
    retry, with a ``UnicodeEncodeError`` before anything was sent. A value stored another way
    with characters beyond Latin-1 goes as UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace")


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
