"""The parts every webhook check shares: the receiver, signed deliveries, one run's state.

:class:`WebhookTarget` names the endpoint and how its source is signed; :class:`WebhookRun`
signs and sends deliveries (only to that endpoint, and one sibling path), waits for their effects
and keeps what later checks judge. The checks register on :data:`suite` in
:mod:`.webhook_signatures` and :mod:`.webhook_deliveries`, in the order they run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pgonce.conformance.effects import Effects, settled_count
from pgonce.conformance.report import Finding
from pgonce.conformance.runner import (
    Suite,
    answered,
    patiently,
    request,
    server_failed,
    shown,
)
from pgonce.core.urls import public
from pgonce.extras import needs
from pgonce.webhooks.schemes.base import SigningScheme

with needs("http", "pgonce conformance"):
    import httpx

STANDARD = "Standard Webhooks spec"
STRIPE = "Stripe docs, Webhooks"
GITHUB = "GitHub docs, Validating webhook deliveries"
SLACK = "Slack docs, Verifying requests"

#: Copies of one event in the retry storm: providers retry on timeouts and at-least-once queues
#: redeliver in bursts; twenty at once exceeds any real storm of one event and takes a second.
DEFAULT_COPIES = 20

#: Longest acceptable time to acknowledge one delivery, in seconds. Slack requires an answer within
#: 3 seconds, GitHub within 10, Stripe asks for a 2xx "quickly, before any complex logic".
DEFAULT_ACK_SECONDS = 3.0

#: How long an accepted delivery may take to show its effect (a worker handles it after the 200),
#: and how long the count must then hold still to rule out a late second effect.
EFFECT_TIMEOUT = 15.0
SETTLE_SECONDS = 0.5


@dataclass(frozen=True)
class WebhookTarget:
    """The receiver's endpoint and how its source is signed (``secret`` is never shown)."""

    url: str
    scheme: str
    secret: str = field(repr=False)
    tolerance: timedelta = timedelta(minutes=5)
    options: Mapping[str, object] = field(default_factory=dict)
    max_body_bytes: int = 1024 * 1024
    copies: int = DEFAULT_COPIES
    ack_seconds: float = DEFAULT_ACK_SECONDS
    effect_timeout: float = EFFECT_TIMEOUT
    settle: float = SETTLE_SECONDS


def event_body(event_id: str, run: str, amount: int = 4200) -> bytes:
    """A delivery body naming ``event_id`` where every scheme looks for it (``id``, ``event_id``),
    with ``data`` as pgonce's demo handler reads it; spaced and escaped so that it is not what
    ``json.dumps`` of its parse gives back."""
    return (
        f'{{ "id": "{event_id}", "event_id": "{event_id}", "type": "conformance.check",\n'
        f'  "data": {{ "order": "{event_id}", "run": "{run}", "amount": {amount},'
        ' "note": "caf\\u00e9 \\u2713" } }\n'
    ).encode()


@dataclass
class WebhookRun:
    target: WebhookTarget
    client: httpx.AsyncClient
    effects: Effects | None
    scheme: SigningScheme
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: Every refusal the checks expected, for the problem+json check: (what, response).
    refusals: list[tuple[str, httpx.Response]] = field(default_factory=list)
    #: What the server failed on (a 5xx) where the checks expected a refusal.
    failures: list[str] = field(default_factory=list)
    #: Seconds each accepted delivery took to be answered.
    ack_times: list[float] = field(default_factory=list)
    #: Distinct events the receiver should have acted on, and the count when the run began.
    accepted_events: int = 0
    start_count: int | None = None

    def new_event(self, amount: int = 4200) -> tuple[str, bytes]:
        event_id = f"evt_conformance_{uuid.uuid4().hex[:16]}"
        return event_id, event_body(event_id, self.run, amount)

    def sign(
        self,
        body: bytes,
        event_id: str,
        *,
        at: datetime | None = None,
        scheme: SigningScheme | None = None,
    ) -> dict[str, str]:
        signed = (scheme or self.scheme).sign(
            body, event_id=event_id, timestamp=at or datetime.now(UTC)
        )
        return {**signed, "content-type": "application/json"}

    async def post(
        self,
        body: bytes,
        headers: Mapping[str, str],
        *,
        url: str | None = None,
        patient: bool = True,
    ) -> httpx.Response:
        """One delivery. A 429 Too Many Requests is sent again after its Retry-After
        (:func:`~pgonce.conformance.runner.patiently`), as a provider does, unless not
        ``patient``: a copy in a storm is judged as the receiver answered it then."""
        target = url or self.target.url

        async def once() -> httpx.Response:
            started = time.monotonic()
            response = await request(self.client, "POST", target, content=body, headers=headers)
            if response.is_success:
                self.ack_times.append(time.monotonic() - started)
            return response

        return await (patiently(once, f"the delivery to {public(target)}") if patient else once())

    async def count(self) -> int | None:
        return None if self.effects is None else await self.effects.count()

    async def settled(self, reach: int) -> int:
        assert self.effects is not None
        return await settled_count(
            self.effects,
            reach=reach,
            within=self.target.effect_timeout,
            settle=self.target.settle,
        )

    async def one_effect(self, before: int | None, finding: Finding, acknowledged: bool) -> None:
        """Expect one new effect since ``before`` if the event was acknowledged, else none
        (waiting for the worker that handles it after the acknowledgement)."""
        expected = 1 if acknowledged else 0
        self.accepted_events += expected
        if before is None:
            return
        after = await self.settled(before + expected)
        finding.expect(after - before == expected, f"effects +{after - before}, not +{expected}")
        if after - before == expected:
            finding.saw(f"effects +{expected}")

    def refused(
        self,
        finding: Finding,
        response: httpx.Response,
        status: int | range | tuple[int, ...],
        what: str,
    ) -> None:
        finding.saw(f"{what}: {shown(response)}")
        ok = (
            response.status_code == status
            if isinstance(status, int)
            else (response.status_code in status)
        )
        expected = (
            str(status)
            if isinstance(status, int)
            else "a 4xx"
            if isinstance(status, range)
            else " or ".join(map(str, status))
        )
        finding.expect(ok, answered(what, response, expected))
        if 400 <= response.status_code < 500:
            # A 5xx is the server failing, not a refusal: the problem+json check judges none.
            self.refusals.append((what, response))
        elif server_failed(response):
            self.failures.append(what)

    def signature_headers(self) -> set[str]:
        """The headers that carry the signature: those that change with the body alone."""
        moment = datetime.now(UTC)
        one = self.scheme.sign(b'{"a":1}', event_id="evt_probe", timestamp=moment)
        two = self.scheme.sign(b'{"a":2}', event_id="evt_probe", timestamp=moment)
        return {name for name, value in one.items() if two.get(name) != value}

    def signs_time(self) -> bool:
        moment = datetime.now(UTC)
        one = self.scheme.sign(b"{}", event_id="evt_probe", timestamp=moment)
        two = self.scheme.sign(b"{}", event_id="evt_probe", timestamp=moment - timedelta(hours=1))
        return one != two


#: The answers that refuse a delivery whose signature does not verify. pgonce answers 401; the
#: providers' own sample receivers answer 400 (Stripe's, Standard Webhooks'), others 403. Each
#: refuses before anything is stored, which is what the checks judge.
SIGNATURE_REFUSED = (400, 401, 403)

#: A webhook check may wait for a late effect (:data:`EFFECT_TIMEOUT`) and for the count to hold
#: still after it: its share of the budget is never less than that, while that much is left.
suite: Suite[WebhookRun] = Suite("webhooks", floor=EFFECT_TIMEOUT + 5)
