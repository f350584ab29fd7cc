"""The parts every Idempotency-Key check shares: what to send, one run's state, the suite.

:class:`HttpTarget` is the request an endpoint accepts with a new key; :class:`HttpRun` sends it
(only to the endpoint's origin), reads the effect count and keeps the answers that several
checks judge. The checks register on :data:`suite` in :mod:`.http_keys` and
:mod:`.http_replays`, in the order they run.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from pgonce.conformance.effects import Effects
from pgonce.conformance.report import Finding
from pgonce.conformance.runner import (
    Suite,
    answered,
    is_problem,
    patiently,
    request,
    shown,
)
from pgonce.core.urls import public
from pgonce.errors import UsageError
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx

DRAFT = "draft-ietf-httpapi-idempotency-key-header"
STRIPE = "Stripe API docs, Idempotent requests"

#: RFC 9110's token (a method, a field name) and a field value the kit can send as is.
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
FIELD_VALUE = re.compile(r"[\x20-\x7e\t]*")

#: The request header the checks exercise.
KEY_HEADER = "Idempotency-Key"

#: Concurrent copies of one request in the concurrency check: Stripe's and the draft's case is a
#: client (or a proxy) retrying before the first answer came back; fifty at once is a burst that a
#: check-then-insert implementation does not survive, and still a second's work for a real one.
DEFAULT_CONCURRENCY = 50

#: The request body size the 413 check exceeds by one byte (pgonce's default limit, and a common
#: proxy default).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class HttpTarget:
    """What to send: one request that the endpoint accepts (a 2xx) when it carries a new key."""

    url: str
    body: bytes = b"{}"
    content_type: str = "application/json"
    method: str = "POST"
    #: Headers of every request (credentials of the first principal).
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Headers naming another principal, for the scope check (None: skipped).
    other_headers: Mapping[str, str] | None = None
    #: Another body the endpoint accepts, for the mismatch check (None: derived from a JSON body).
    other_body: bytes | None = None
    key_required: bool = True
    #: Paths on the same origin: an endpoint answering 5xx, one setting a cookie, one for GET.
    fail_path: str | None = None
    cookie_path: str | None = None
    safe_path: str | None = None
    #: A path on the same origin whose endpoint takes a while (a second), for the in-flight check.
    slow_path: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    concurrency: int = DEFAULT_CONCURRENCY
    expires_header: str = "Idempotency-Key-Expires"
    replay_header: str = "Idempotent-Replayed"

    def __post_init__(self) -> None:
        for given in (self.headers, self.other_headers or {}):
            if any(name.lower() == KEY_HEADER.lower() for name in given):
                # Every check chooses its own key (or none): a fixed one would be sent as well.
                raise UsageError(f"the kit sets {KEY_HEADER} itself: remove it from the headers")
        # What the wire cannot carry is refused here, not by the HTTP client mid-run.
        if not TOKEN.fullmatch(self.method):
            raise UsageError(f"{self.method!r} is not an HTTP method")
        names = {self.expires_header: "", self.replay_header: ""}
        for name, value in [
            ("Content-Type", self.content_type),
            *names.items(),
            *self.headers.items(),
            *(self.other_headers or {}).items(),
        ]:
            if not TOKEN.fullmatch(name):
                raise UsageError(f"{name!r} is not an HTTP header name")
            if not FIELD_VALUE.fullmatch(value):
                # The value may be a credential read from the environment: never shown.
                raise UsageError(f"the value of the {name} header is not printable ASCII")


def new_key() -> str:
    """A fresh key, written as the draft's sf-string (a quoted string)."""
    return f'"conformance-{uuid.uuid4().hex}"'


def same_origin(url: str, path: str) -> str:
    """``path`` on ``url``'s origin: the kit never sends to another host. The URL's query (a
    gateway's ``?token=``) goes with it, as it goes with every request to the URL, unless
    ``path`` gives a query of its own."""
    parts = urlsplit(url)
    relative = urlsplit(path)
    if relative.scheme or relative.netloc or not path.startswith("/"):
        raise UsageError(f"{public(path)!r} must be a path on the endpoint's server, such as /fail")
    return urlunsplit(
        (parts.scheme, parts.netloc, relative.path, relative.query or parts.query, "")
    )


@dataclass
class HttpRun:
    """One run's state: the client, the effect count, and answers that several checks judge."""

    target: HttpTarget
    client: httpx.AsyncClient
    effects: Effects | None
    pair: tuple[httpx.Response, httpx.Response, int | None] | None = None
    bursts: list[list[httpx.Response]] = field(default_factory=list)

    async def send(
        self,
        key: str | None,
        *,
        url: str | None = None,
        body: bytes | None = None,
        method: str | None = None,
        headers: Mapping[str, str] | None = None,
        patient: bool = True,
    ) -> httpx.Response:
        """One request with ``key`` (None: without the header). A 429 Too Many Requests is sent
        again after its Retry-After (:func:`~pgonce.conformance.runner.patiently`) unless not
        ``patient``: a copy in a burst, or a retry that must arrive while its original runs, is
        judged as the server answered it then."""
        # Case-insensitive: a given "Content-Type" replaces the default instead of joining it.
        sent = httpx.Headers({"content-type": self.target.content_type})
        sent.update(headers or self.target.headers)
        if key is not None:
            sent[KEY_HEADER] = key
        method = method or self.target.method
        content = None if method in ("GET", "HEAD") else (body or self.target.body)
        target = url or self.target.url

        def once() -> Awaitable[httpx.Response]:
            return request(self.client, method, target, content=content, headers=sent)

        what = f"{method} {public(target)}"
        response = await (patiently(once, what) if patient else once())
        # A cookie set by one check must not reach the next: the kit's requests carry none.
        self.client.cookies.clear()
        return response

    async def count(self) -> int | None:
        return None if self.effects is None else await self.effects.count()

    async def effects_since(self, before: int | None, expected: int, finding: Finding) -> None:
        """Expect ``expected`` effects since ``before`` (nothing to judge without a count)."""
        if before is None:
            return
        after = await self.count()
        assert after is not None
        finding.expect(after - before == expected, f"effects +{after - before}, not +{expected}")
        if after - before == expected:
            finding.saw(f"effects +{expected}")

    def replayed(self, response: httpx.Response) -> bool:
        return str(response.headers.get(self.target.replay_header, "")).lower() == "true"

    async def first_pair(self) -> tuple[httpx.Response, httpx.Response, int | None]:
        """The original and one retry with the same key, and the effects they made."""
        if self.pair is None:
            before = await self.count()
            key = new_key()
            first = await self.send(key)
            second = await self.send(key)
            after = await self.count()
            self.pair = (first, second, None if before is None else (after or 0) - before)
        return self.pair


suite: Suite[HttpRun] = Suite("http")


def refused(finding: Finding, response: httpx.Response, status: int, what: str) -> None:
    """Expect ``response`` to refuse ``what`` with ``status`` and a problem document."""
    finding.saw(f"{what}: {shown(response)}")
    finding.expect(response.status_code == status, answered(what, response, str(status)))
    if response.status_code == status:
        finding.expect(
            is_problem(response), f"{what}: the {status} is not application/problem+json"
        )
