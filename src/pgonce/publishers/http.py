"""Outgoing webhooks signed per Standard Webhooks (httpx).

Each row is one ``POST`` to the endpoint ``routing(message)``, with the body
``{"type": ..., "timestamp": ..., "data": <payload>}`` (the timestamp is the event's
``created_at``, so a row sent again has the same body) and the headers ``webhook-id`` (the outbox
id: receivers dedupe on it), ``webhook-timestamp`` (the time of sending) and ``webhook-signature``
(HMAC-SHA256 over ``id.timestamp.body`` with a ``whsec_`` secret, or Ed25519 with a ``whsk_``
one). The signing is the one :class:`~pgonce.webhooks.schemes.standard_webhooks.StandardWebhooks`
scheme the inbox verifies with, so the two sides cannot disagree.

A 2xx answer acknowledges the row; anything else, a timeout, a refused connection or a routing
function that raised for the row is a refusal:
the endpoint belongs to someone else, so its downtime counts against the retry policy and ends in
parking rather than in rows that wait forever. The rows of one aggregate are sent one after the
other, and an aggregate stops at its first failure (its later rows wait, unsettled), so a receiver
never gets an aggregate's events out of order; different aggregates are sent concurrently.

With a fixed ``url``, the TCP connect to its origin is made before a batch (:meth:`prepare`)
whenever no connection to it is likely open: a relay's stop cancels that connect at once (nothing
of the batch went out), where a connect inside :meth:`publish` counted as rows at the endpoint and
held the stop for its whole grace. With a routing function (or a url reached through a proxy)
the connect is part of each row's request; the publisher tells the relay when a request's first
bytes go out (``reports_sending``), and a stop before that cancels the batch at once too, its
rows untouched for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import ConfigError
from pgonce.extras import needs
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    check_timeout,
    route_or_refuse,
    sending,
    short_error,
    url_origin,
)
from pgonce.webhooks.schemes.standard_webhooks import StandardWebhooks

with needs("http", "the signed HTTP publisher"):
    import httpx

#: Per-request timeout. Receivers are expected to acknowledge fast and work later (Standard
#: Webhooks recommends answering within seconds); 15 s leaves room for a slow one.
DEFAULT_TIMEOUT = timedelta(seconds=15)
#: Aggregates sent at once; bounds the connections opened to one receiver.
DEFAULT_CONCURRENCY = 16
#: How long httpx keeps an idle connection for the next request (its own default). A fixed url
#: answered within this (less a second of margin) is taken for connected: the next batch goes out
#: on the kept connection, with no connect of its own (see :attr:`HttpPublisher.connected`).
KEEPALIVE_SECONDS = 5.0


#: The kinds of refusal, as the relay counts and logs them: no answer in time, no connection (or
#: it broke), a row HTTP cannot carry, a redirect (not followed), any other answer by its class.
KINDS = ("timeout", "unreachable", "unsendable", "redirected", "http_3xx", "http_4xx", "http_5xx")


#: Headers that frame or address a request, which httpx sets from the body and the URL.
_REQUEST_HEADERS = frozenset({"content-length", "transfer-encoding", "host"})


#: Most bytes of an answer's body read (and dropped). Only the status decides; reading a short
#: body to its end lets the connection be reused, and a longer one is cut there.
MAX_DISCARDED_BODY = 64 * 1024
#: Longest the body is read for (or the request's timeout, when shorter). The status has arrived:
#: a body that trickles in (an endpoint that streams, a slow proxy) would otherwise hold the
#: row's acknowledgement, and the rows of its aggregate behind it, for a whole timeout more.
MAX_DISCARD_SECONDS = 1.0


async def _discard(response: httpx.Response, seconds: float) -> None:
    """Read and drop the body of ``response`` (up to :data:`MAX_DISCARDED_BODY`, within
    ``seconds`` and :data:`MAX_DISCARD_SECONDS`) and close it. A failure here changes nothing:
    the status has arrived; a body not read to its end closes the connection."""
    seconds = min(seconds, MAX_DISCARD_SECONDS)
    try:
        async with asyncio.timeout(seconds):
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read > MAX_DISCARDED_BODY:
                    break
    except (httpx.HTTPError, TimeoutError):
        pass
    finally:
        with contextlib.suppress(httpx.HTTPError):
            await response.aclose()


#: Set while this publisher sends, in the sending task's context: what httpx logs then is ours.
_SENDING: contextvars.ContextVar[bool] = contextvars.ContextVar("pgonce_webhook", default=False)


class _OriginsOnly(logging.Filter):
    """Shows only the origin of the URL in what httpx logs of a webhook's request.

    httpx logs every request at INFO with its whole URL: a password in it, a token in its path or
    query (many receivers authenticate so), in the logs of any application logging at INFO, once
    per event. Requests of other httpx clients in the process are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SENDING.get() and isinstance(record.args, tuple):
            record.args = tuple(
                url_origin(str(arg)) if isinstance(arg, httpx.URL) else arg for arg in record.args
            )
        return True


_ORIGINS_ONLY = _OriginsOnly()
logging.getLogger("httpx").addFilter(_ORIGINS_ONLY)


class HttpPublisher:
    """POSTs each row to ``url`` (or to ``routing(message)``), signed with ``secret``."""

    name = "http"
    #: publish() says when a request's first bytes go out (see Publisher): a stop before that,
    #: while a connect inside it waits, cancels the batch at once.
    reports_sending = True

    def __init__(
        self,
        *,
        secret: str,
        url: str | None = None,
        routing: Routing | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        concurrency: int = DEFAULT_CONCURRENCY,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if (url is None) == (routing is None):
            raise ConfigError("give the webhook publisher either a url or a routing function")
        # Said at the start: a URL httpx cannot send to would otherwise show as every row
        # refused, half an hour later as every row parked.
        if url is not None:
            origin = url_origin(url) if isinstance(url, str) else type(url).__name__
            if not origin.startswith(("http://", "https://")):
                raise ConfigError(
                    "the webhook publisher's url must be an http:// or https:// URL with a "
                    f"host, not {origin}"
                )
        check_timeout("the webhook publisher's timeout", timeout)
        # Semaphore(0) would make every batch wait for ever.
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError("the webhook publisher's concurrency must be at least 1")
        self._routing: Routing = routing or (lambda _message: url or "")
        self._signer = StandardWebhooks([secret])
        self.timeout = timeout
        self.concurrency = concurrency
        self._clock = clock or (lambda: datetime.now(UTC))
        self._client: httpx.AsyncClient | None = None
        #: The fixed url, when one was given and httpx reaches it directly (no proxy): its
        #: origin is connected to before a batch (see prepare()).
        self._direct = url if url is not None and not _proxied(url) else None
        #: When the fixed url last answered (time.monotonic()): its connection is kept by httpx.
        self._answered_at: float | None = None
        #: What prepare()'s connect to the fixed url met, by the batch's task (the relay calls
        #: prepare() and then publish() in it; batches of other tasks prepare on their own).
        self._unreachable: weakref.WeakKeyDictionary[asyncio.Task[Any], tuple[str, str]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def connected(self) -> bool:
        """Whether the next batch needs no connect before its rows go out.

        With a fixed url, True while it answered within httpx's keep-alive (its connection is
        kept): otherwise the relay calls :meth:`prepare` first, whose connect a stop cancels at
        once. With a routing function (or a url reached through a proxy) always True: each row's
        connect is part of its request and its timeout, and a stop before the first request's
        bytes go out cancels the batch at once (``reports_sending``)."""
        if self._direct is None:
            return True
        answered = self._answered_at
        return answered is not None and time.monotonic() - answered < KEEPALIVE_SECONDS - 1

    async def prepare(self) -> None:
        """Connect to the fixed url's origin (TCP), and close the connection.

        A relay calls this before a batch when the publisher is not :attr:`connected`, as
        "connecting": a stop cancels it at once, and the batch's rows wait for the next run
        (nothing of them went out), instead of the stop waiting out its grace for an endpoint
        that never accepts (a host that drops SYNs). A failure is not raised: the endpoint's
        downtime is a refusal of its rows, counted against the retry policy, not an outage they
        wait out. The batch's rows to the url (publish() in the same task) are refused with it,
        without a connect of their own: it was their attempt.
        """
        task = asyncio.current_task()
        if task is not None:
            self._unreachable.pop(task, None)
        if self._direct is None:
            return
        url = httpx.URL(self._direct)
        origin = url_origin(self._direct)
        port = url.port or (443 if url.scheme == "https" else 80)
        seconds = self.timeout.total_seconds()
        failure: tuple[str, str]
        try:
            async with asyncio.timeout(seconds):
                _, writer = await asyncio.open_connection(url.host, port)
        except TimeoutError:
            failure = f"webhook to {origin} gave no answer within {seconds:g} s", "timeout"
        except OSError as error:
            failure = f"webhook to {origin} failed: {short_error(error)}", "unreachable"
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        if task is not None:
            self._unreachable[task] = failure

    def request(self, message: OutboxMessage) -> tuple[bytes, dict[str, str]]:
        """The body and headers of ``message``'s delivery (public for tests and receivers' docs)."""
        # The envelope's timestamp is the event's, the same at every delivery: a row sent again
        # (its published mark lost) has the same body, which receivers that tell a duplicate
        # from a conflict by the body's digest (pgonce's inbox does) answer as a duplicate. The
        # signature's timestamp is the time of sending, which receivers hold to a tolerance.
        created = message.created_at.astimezone(UTC)
        envelope = {
            "type": message.type,
            "timestamp": created.isoformat().replace("+00:00", "Z"),
            "data": message.payload,
        }
        content = json.dumps(envelope, separators=(",", ":"), ensure_ascii=False).encode()
        headers = self._signer.sign(content, event_id=message.message_id, timestamp=self._clock())
        headers["content-type"] = "application/json"
        # The caller's outbox headers travel too, but never over the signature's own headers,
        # nor over those that frame or address the request: the receiver would read another
        # body than the one signed, or be another host (a ValueError: the row is refused).
        for name, value in message.headers.items():
            lowered = name.lower()
            if lowered in _REQUEST_HEADERS:
                raise ValueError(
                    f"the outbox header {name!r} is one HTTP sets itself for the request; a "
                    "webhook cannot carry it"
                )
            headers.setdefault(lowered, value)
        return content, headers

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.timeout.total_seconds(),
                limits=httpx.Limits(
                    max_connections=100,
                    max_keepalive_connections=20,
                    keepalive_expiry=KEEPALIVE_SECONDS,
                ),
            )
        client = self._client
        # prepare()'s failure to connect stands for this batch's attempt at the url.
        task = asyncio.current_task()
        unreachable = self._unreachable.pop(task, None) if task is not None else None
        by_aggregate: dict[tuple[str, str], list[OutboxMessage]] = {}
        for message in batch:
            by_aggregate.setdefault((message.aggregatetype, message.aggregateid), []).append(
                message
            )
        acked: set[int] = set()
        refused: dict[int, str] = {}
        kinds: dict[int, str] = {}
        gate = asyncio.Semaphore(self.concurrency)

        async def send_in_order(messages: list[OutboxMessage]) -> None:
            async with gate:
                for message in messages:
                    # Raised out of the gather, it would lose the answers of every aggregate
                    # (sent again, duplicated) and fail every batch that holds the row.
                    url = route_or_refuse(self._routing, message, refused, kinds)
                    if url is None:
                        return
                    failure = (
                        unreachable
                        if unreachable is not None and url == self._direct
                        else await self._send(client, message, url)
                    )
                    if failure is not None:
                        refused[message.id], kinds[message.id] = failure
                        return
                    acked.add(message.id)

        await asyncio.gather(*(send_in_order(m) for m in by_aggregate.values()))
        return PublishResult(frozenset(acked), refused, kinds)

    async def _send(
        self, client: httpx.AsyncClient, message: OutboxMessage, url: str
    ) -> tuple[str, str] | None:
        """None when the endpoint acknowledged ``message``; else the reason and its kind (one
        of :data:`KINDS`): the relay logs each kind of an aggregate type on its own line, and
        counts it under its name."""
        seconds = self.timeout.total_seconds()
        # In this task's context only: the other aggregates' sends are tasks of their own.
        _SENDING.set(True)
        try:
            content, headers = self.request(message)
            # httpx's timeout bounds each read, not the request: an endpoint that trickles its
            # answer a byte at a time would hold the batch (and its rows' locks) for ever.
            async with asyncio.timeout(seconds):
                request = client.build_request(
                    "POST", url, content=content, headers=headers, extensions={"trace": _traced}
                )
                response = await client.send(request, stream=True)
        except TimeoutError:
            self._answered(url, None)
            return f"webhook to {url_origin(url)} gave no answer within {seconds:g} s", "timeout"
        except httpx.HTTPError as error:
            self._answered(url, None)
            kind = (
                "timeout"
                if isinstance(error, httpx.TimeoutException)
                else "unsendable"
                if isinstance(error, httpx.LocalProtocolError | httpx.UnsupportedProtocol)
                else "unreachable"
            )
            return f"webhook to {url_origin(url)} failed: {short_error(error)}", kind
        except httpx.InvalidURL:
            # Its message may quote the URL, credentials and all.
            return (
                f"webhook to {url_origin(url)} could not be sent: the URL is invalid",
                "unsendable",
            )
        except ValueError as error:
            # A header that HTTP cannot carry (a value outside ASCII: UnicodeEncodeError): this
            # row can never be sent. Raised, it would fail every batch that holds the row,
            # without an attempt counted; refused, it is parked in the end like any refusal.
            return f"webhook to {url_origin(url)} could not be sent: {short_error(error)}", (
                "unsendable"
            )
        self._answered(url, time.monotonic())
        await _discard(response, seconds)
        status = response.status_code
        if 200 <= status < 300:
            return None
        location = response.headers.get("location")
        if 300 <= status < 400 and location:
            # Not followed: the delivery is signed for the receiver at this address, and a
            # redirect may lead anywhere. Only the origin is shown: the rest may hold a token.
            try:
                target = url_origin(str(response.url.join(location)))
            except (httpx.InvalidURL, ValueError):
                target = "an invalid URL"
            return (
                f"webhook to {url_origin(url)} answered {status}, a redirect to {target}; the "
                "publisher does not follow redirects: set its url to the address that answers"
            ), "redirected"
        return f"webhook to {url_origin(url)} answered {status}", f"http_{status // 100}xx"

    def _answered(self, url: str, at: float | None) -> None:
        """Note when the fixed url answered; None: it did not (its connection is not kept)."""
        if url == self._direct:
            self._answered_at = at

    async def close(self) -> None:
        self._answered_at = None
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


async def _traced(event: str, info: dict[str, Any]) -> None:
    """httpcore's trace of a request: the start of its headers' sending (after any connect, to
    the endpoint or to a proxy) is when the row goes out (see :func:`sending`). Not the CONNECT
    that asks a proxy for a tunnel to an https endpoint: httpcore traces it as a request too,
    with the request's own trace, and nothing of the row has gone out before the tunnel is up."""
    if event.endswith(".send_request_headers.started"):
        request = info.get("request")
        if getattr(request, "method", None) != b"CONNECT":
            sending()


def _proxied(url: str) -> bool:
    """Whether httpx sends to ``url`` through a proxy of the environment (HTTP_PROXY, ...,
    NO_PROXY): the publisher then cannot connect to its origin itself."""
    try:
        host = httpx.URL(url).host
        return bool(urllib.request.getproxies()) and not urllib.request.proxy_bypass(host)
    except (httpx.InvalidURL, ValueError, OSError):
        return True
