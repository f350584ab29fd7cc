"""The webhook receiver checks: what a safe receiver must do with deliveries, judged from outside.

The kit signs deliveries the way the provider does (pgonce's signer for the scheme, and the
provider's own library where one is published: :mod:`.providers`) with the secret it is given,
sends them to the one endpoint URL (and, for the unknown-source check, to a sibling path whose
last segment names no source), and judges the answers and the effect count.

Delivery bodies are deliberately not in canonical form (spaces, ``\\u`` escapes): a receiver that
verifies a parsed and re-serialized body instead of the raw bytes refuses them, as it would refuse
real deliveries whenever the provider's serializer and its own disagree.

Sources cited by the checks: the Standard Webhooks specification (standardwebhooks.com), Stripe's
webhook docs (docs.stripe.com/webhooks), GitHub's (docs.github.com/webhooks), Slack's request
verification docs (api.slack.com/authentication/verifying-requests-from-slack), and RFC 9110 /
RFC 9457 for statuses and problem documents.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets as random_secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

from pgonce.conformance.effects import Effects, settled_count
from pgonce.conformance.providers import provider_signer
from pgonce.conformance.report import Finding, Report, digest
from pgonce.conformance.runner import (
    DEFAULT_BUDGET,
    Suite,
    client,
    is_problem,
    request,
    shown,
)
from pgonce.errors import ConfigError, UsageError
from pgonce.extras import needs
from pgonce.webhooks.schemes import build_scheme
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
        self, body: bytes, headers: Mapping[str, str], *, url: str | None = None
    ) -> httpx.Response:
        started = time.monotonic()
        response = await request(
            self.client, "POST", url or self.target.url, content=body, headers=headers
        )
        if response.is_success:
            self.ack_times.append(time.monotonic() - started)
        return response

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
        self, finding: Finding, response: httpx.Response, status: int | range, what: str
    ) -> None:
        finding.saw(f"{what}: {shown(response)}")
        ok = (
            response.status_code in status
            if isinstance(status, range)
            else (response.status_code == status)
        )
        expected = "a 4xx" if isinstance(status, range) else str(status)
        finding.expect(ok, f"{what} answered {response.status_code}, not {expected}")
        if response.status_code >= 400:
            self.refusals.append((what, response))

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


suite: Suite[WebhookRun] = Suite("webhooks")


@suite.check(
    "signed-accepted",
    "a delivery signed as the provider signs it, on its raw bytes, is acknowledged with a 2xx",
    f"{STANDARD}, Verifying webhook authenticity; {STRIPE} (the raw body); {GITHUB}",
)
async def signed_accepted(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, body = run.new_event()
    before = await run.count()
    response = await run.post(body, run.sign(body, event_id))
    finding.saw(f"{shown(response)} for a non-canonical JSON body of {digest(body)}")
    finding.expect(
        response.is_success, f"a validly signed delivery answered {response.status_code}"
    )
    await run.one_effect(before, finding, response.is_success)
    return finding


@suite.check(
    "provider-library-accepted",
    "a delivery signed by the provider's own published library is acknowledged with a 2xx",
    "the provider's library: standardwebhooks, stripe, slack-sdk (PyPI)",
)
async def provider_library_accepted(run: WebhookRun) -> Finding:
    finding = Finding()
    signer = provider_signer(run.target.scheme, run.target.secret)
    if isinstance(signer, str):
        return finding.skip(signer)
    event_id, body = run.new_event()
    headers = {**signer.sign(body, event_id, datetime.now(UTC)), "content-type": "application/json"}
    before = await run.count()
    response = await run.post(body, headers)
    finding.saw(f"signed by {signer.library}: {shown(response)}")
    finding.expect(
        response.is_success, f"{signer.library}'s delivery answered {response.status_code}"
    )
    await run.one_effect(before, finding, response.is_success)
    return finding


@suite.check(
    "fast-acknowledgement",
    "providers time out slow receivers and redeliver: acknowledge first, handle after",
    f"{SLACK} (3 s); {GITHUB} (10 s); {STRIPE} (return 2xx quickly)",
)
async def fast_acknowledgement(run: WebhookRun) -> Finding:
    finding = Finding()
    if not run.ack_times:
        return finding.skip("no delivery was acknowledged to time")
    slowest = max(run.ack_times)
    finding.saw(f"slowest acknowledgement {slowest * 1000:.0f} ms of {len(run.ack_times)}")
    finding.expect(
        slowest <= run.target.ack_seconds,
        f"an acknowledgement took {slowest:.1f} s, over {run.target.ack_seconds:.1f} s",
    )
    return finding


def forged_scheme(target: WebhookTarget) -> SigningScheme:
    """The scheme with a secret nobody configured, in whichever form the scheme accepts."""
    raw = random_secrets.token_bytes(24)
    for candidate in (
        "whsec_" + base64.b64encode(raw).decode(),
        base64.b64encode(raw).decode(),
        raw.hex(),
    ):
        with contextlib.suppress(ConfigError):
            return build_scheme(
                target.scheme, candidate, tolerance=target.tolerance, options=target.options
            )
    raise UsageError(f"cannot make a second secret for the {target.scheme} scheme")


@suite.check(
    "forged-signature-401",
    "a signature made with another secret proves nothing: refused before anything is stored",
    f"{STANDARD}; {STRIPE}; {GITHUB}",
)
async def forged_signature(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, body = run.new_event()
    headers = run.sign(body, event_id, scheme=forged_scheme(run.target))
    run.refused(finding, await run.post(body, headers), 401, "signed with another secret")
    _, other = run.new_event()
    moved = run.sign(other, event_id)  # a genuine signature, of other bytes
    run.refused(finding, await run.post(body, moved), 401, "another body's signature")
    return finding


@suite.check(
    "missing-signature-401",
    "an unsigned delivery is anybody's: refused",
    f"{STANDARD}; {STRIPE}; {GITHUB}",
)
async def missing_signature(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, body = run.new_event()
    names = run.signature_headers()
    headers = {k: v for k, v in run.sign(body, event_id).items() if k not in names}
    run.refused(finding, await run.post(body, headers), 401, "no signature header")
    return finding


@suite.check(
    "malformed-signature-401",
    "a signature header that does not parse is refused as invalid, never a 500",
    f"{STANDARD}; RFC 9110 §15.5.2 (401 Unauthorized)",
)
async def malformed_signature(run: WebhookRun) -> Finding:
    finding = Finding()
    names = run.signature_headers()
    for garbage in ("v1,@@not-base64@@", "t=abc,v1=zz", "sha256="):
        event_id, body = run.new_event()
        headers = {**run.sign(body, event_id), **dict.fromkeys(names, garbage)}
        run.refused(finding, await run.post(body, headers), 401, f"signature {garbage!r}")
    return finding


async def out_of_tolerance(run: WebhookRun, shift: timedelta, what: str) -> Finding:
    finding = Finding()
    if not run.signs_time():
        return finding.skip(f"the {run.target.scheme} scheme signs no timestamp")
    event_id, body = run.new_event()
    moment = datetime.now(UTC) + shift
    run.refused(finding, await run.post(body, run.sign(body, event_id, at=moment)), 401, what)
    return finding


@suite.check(
    "stale-timestamp-401",
    "a captured delivery replayed later is refused: the signed timestamp bounds replays",
    f"{STANDARD} (tolerance); {STRIPE} (5 minutes); {SLACK}",
)
async def stale_timestamp(run: WebhookRun) -> Finding:
    shift = -(run.target.tolerance + timedelta(minutes=2))
    return await out_of_tolerance(run, shift, f"signed {-shift.total_seconds():.0f} s ago")


@suite.check(
    "future-timestamp-401",
    "a timestamp far ahead would stay valid for long: tolerance holds both ways",
    f"{STANDARD} (tolerance in both directions)",
)
async def future_timestamp(run: WebhookRun) -> Finding:
    shift = run.target.tolerance + timedelta(minutes=2)
    return await out_of_tolerance(run, shift, f"signed {shift.total_seconds():.0f} s ahead")


@suite.check(
    "non-utf8-body-4xx",
    "an authentic but undecodable body is the sender's fault: a 4xx, never a 500",
    "RFC 8259 §8.1 (JSON is UTF-8); RFC 9110 §15.5.1",
)
async def non_utf8_body(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, _ = run.new_event()
    body = b'{ "id": "%s", "event_id": "%s", "note": "\xff\xfe" }' % (
        event_id.encode(),
        event_id.encode(),
    )
    run.refused(
        finding, await run.post(body, run.sign(body, event_id)), range(400, 500), "non-UTF-8"
    )
    return finding


@suite.check(
    "malformed-json-4xx",
    "an authentic but malformed body is answered 4xx, never a 500 and a retry loop",
    "RFC 9110 §15.5.1 (400 Bad Request); RFC 9457",
)
async def malformed_json(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, _ = run.new_event()
    body = b'{ "id": "%s", "event_id": "%s", "data": ' % (event_id.encode(), event_id.encode())
    run.refused(
        finding, await run.post(body, run.sign(body, event_id)), range(400, 500), "truncated JSON"
    )
    return finding


@suite.check(
    "oversized-body-413",
    "a receiver that buffers any body is a memory attack waiting to happen",
    "RFC 9110 §15.5.14 (413 Content Too Large)",
)
async def oversized_body(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, _ = run.new_event()
    size = run.target.max_body_bytes + 1
    head = b'{"id":"%s","event_id":"%s","pad":"' % (event_id.encode(), event_id.encode())
    body = head + b"x" * max(0, size - len(head) - 2) + b'"}'
    headers = run.sign(body, event_id)
    run.refused(finding, await run.post(body, headers), 413, f"a body of {digest(body)}")
    return finding


def sibling(url: str) -> str | None:
    """The endpoint's URL with its last path segment replaced by a name no source has."""
    parts = urlsplit(url)
    head, sep, last = parts.path.rstrip("/").rpartition("/")
    if not sep or not last:
        return None
    path = f"{head}/conformance-unknown-{uuid.uuid4().hex[:8]}"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@suite.check(
    "unknown-source-404",
    "a delivery for a source nobody configured is not silently accepted (and lost)",
    "RFC 9110 §15.5.5 (404 Not Found)",
)
async def unknown_source(run: WebhookRun) -> Finding:
    finding = Finding()
    url = sibling(run.target.url)
    if url is None:
        return finding.skip("the URL has no last path segment naming the source")
    event_id, body = run.new_event()
    run.refused(
        finding, await run.post(body, run.sign(body, event_id), url=url), 404, "unknown source"
    )
    return finding


@suite.check(
    "same-id-other-body-409",
    "an event id seen with another body is a provider bug or a spoof: never a silent 2xx",
    f"{STANDARD} (webhook-id is the idempotency key); {STRIPE} (event ids)",
)
async def same_id_other_body(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, body = run.new_event()
    before = await run.count()
    first = await run.post(body, run.sign(body, event_id))
    finding.saw(f"original {shown(first)}")
    finding.expect(first.is_success, f"the original delivery answered {first.status_code}")
    other = event_body(event_id, run.run, amount=4201)
    run.refused(
        finding, await run.post(other, run.sign(other, event_id)), 409, "same id, other body"
    )
    await run.one_effect(before, finding, first.is_success)
    return finding


@suite.check(
    "retry-storm-one-effect",
    "providers redeliver, at once and re-signed: one event must have exactly one effect",
    f"{STRIPE} (duplicate events); {STANDARD} (webhook-id); {GITHUB} (X-GitHub-Delivery)",
)
async def retry_storm(run: WebhookRun) -> Finding:
    finding = Finding()
    event_id, body = run.new_event()
    before = None if run.effects is None else await run.settled(0)
    answers = await asyncio.gather(
        *(run.post(body, run.sign(body, event_id)) for _ in range(run.target.copies))
    )
    counted: dict[int, int] = {}
    for answer in answers:
        counted[answer.status_code] = counted.get(answer.status_code, 0) + 1
    finding.saw(
        f"{len(answers)} copies: " + ", ".join(f"{n}× {s}" for s, n in sorted(counted.items()))
    )
    finding.expect(all(a.is_success for a in answers), "not every copy was acknowledged")
    if before is None:
        if not finding.faults:
            return finding.skip(
                f"{finding.seen[0]}; effects not counted: give --count-url or --count-sql"
            )
        return finding
    await run.one_effect(before, finding, any(a.is_success for a in answers))
    return finding


@suite.check(
    "refusals-no-effect",
    "nothing a receiver refused may act: the effects are exactly the accepted events'",
    "pgonce inbox rules (verify, then store, then handle)",
)
async def refusals_no_effect(run: WebhookRun) -> Finding:
    finding = Finding()
    if run.effects is None or run.start_count is None:
        return finding.skip("effects not counted: give --count-url or --count-sql")
    expected = run.start_count + run.accepted_events
    now = await run.settled(expected)
    finding.saw(f"effects +{now - run.start_count} for {run.accepted_events} accepted events")
    finding.expect(now == expected, "refused or duplicate deliveries had effects")
    return finding


@suite.check(
    "errors-problem-json",
    "a refusal says why in a machine-readable form, and reveals no secret or payload",
    "RFC 9457 (problem details)",
)
async def errors_problem_json(run: WebhookRun) -> Finding:
    finding = Finding()
    if not run.refusals:
        return finding.skip("no delivery was refused")
    plain = [what for what, response in run.refusals if not is_problem(response)]
    finding.saw(
        f"{len(run.refusals) - len(plain)} of {len(run.refusals)} refusals are problem+json"
    )
    finding.expect(not plain, "not application/problem+json: " + ", ".join(plain))
    return finding


def scheme_of(target: WebhookTarget) -> SigningScheme:
    """The scheme the kit signs with; bad configuration is a :class:`ConfigError` here."""
    scheme = build_scheme(
        target.scheme, target.secret, tolerance=target.tolerance, options=target.options
    )
    if not hasattr(scheme, "sign"):
        raise UsageError(f"the {target.scheme} scheme cannot sign")
    return scheme


async def check_webhooks(
    target: WebhookTarget,
    *,
    effects: Effects | None = None,
    budget: float = DEFAULT_BUDGET,
    only: tuple[str, ...] = (),
    http: httpx.AsyncClient | None = None,
) -> Report:
    """Run the webhook checks against ``target``; ``effects`` counts events really handled.

    Raises :class:`~pgonce.errors.UsageError` when the endpoint cannot be reached at all.
    """
    scheme = scheme_of(target)
    async with contextlib.AsyncExitStack() as stack:
        session = http if http is not None else await stack.enter_async_context(client())
        run = WebhookRun(target, session, effects, scheme)
        try:
            await session.request("OPTIONS", target.url)
        except httpx.HTTPError as error:
            raise UsageError(f"cannot reach {target.url}: {error}") from None
        if effects is not None:
            run.start_count = await settled_count(effects, reach=0, within=0, settle=target.settle)
        return await suite.run(run, target.url, budget=budget, only=only)
