"""The Idempotency-Key checks: what a retry-safe endpoint must do, judged from outside.

The kit sends the request it is given (method, body, headers) to one endpoint, with new keys,
and judges the answers and the effect count (:mod:`pgonce.conformance.effects`). Requests go to
the endpoint's origin only: the endpoint itself, and the paths named with ``--fail-path``,
``--cookie-path``, ``--slow-path`` and ``--safe-path``.

Sources cited by the checks:

- the IETF draft: draft-ietf-httpapi-idempotency-key-header (the ``Idempotency-Key`` field, an
  RFC 8941 sf-string; errors 400, 409 and 422; the fingerprint; an expiry policy);
- Stripe's documented semantics (docs.stripe.com/api/idempotent_requests: keys of up to 255
  characters, parameters compared, results saved once the endpoint began);
- RFC 9110 (safe methods, ``Retry-After``), RFC 9457 (problem details), RFC 6265 (cookies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit, urlunsplit

from pgonce.conformance.effects import Effects
from pgonce.conformance.report import Finding, Report, digest
from pgonce.conformance.runner import (
    DEFAULT_BUDGET,
    Suite,
    client,
    is_problem,
    request,
    shown,
)
from pgonce.errors import UsageError
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx

DRAFT = "draft-ietf-httpapi-idempotency-key-header"
STRIPE = "Stripe API docs, Idempotent requests"

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


def new_key() -> str:
    """A fresh key, written as the draft's sf-string (a quoted string)."""
    return f'"conformance-{uuid.uuid4().hex}"'


def same_origin(url: str, path: str) -> str:
    """``path`` on ``url``'s origin: the kit never sends to another host."""
    parts = urlsplit(url)
    relative = urlsplit(path)
    if relative.scheme or relative.netloc or not path.startswith("/"):
        raise UsageError(f"{path!r} must be a path on the endpoint's server, such as /fail")
    return urlunsplit((parts.scheme, parts.netloc, relative.path, relative.query, ""))


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
    ) -> httpx.Response:
        sent = {"content-type": self.target.content_type, **(headers or self.target.headers)}
        if key is not None:
            sent[KEY_HEADER] = key
        method = method or self.target.method
        content = None if method in ("GET", "HEAD") else (body or self.target.body)
        response = await request(
            self.client, method, url or self.target.url, content=content, headers=sent
        )
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
    finding.expect(response.status_code == status, f"{what} answered {response.status_code}")
    if response.status_code == status:
        finding.expect(
            is_problem(response), f"{what}: the {status} is not application/problem+json"
        )


@suite.check(
    "key-required",
    "a request without a key on an endpoint that requires one must not run unprotected",
    f"{DRAFT}, Error Scenarios (400)",
)
async def key_required(run: HttpRun) -> Finding:
    finding = Finding()
    if not run.target.key_required:
        return finding.skip("the endpoint does not require a key (--key-optional)")
    before = await run.count()
    refused(finding, await run.send(None), 400, "no key")
    await run.effects_since(before, 0, finding)
    return finding


async def refused_keys(run: HttpRun, keys: Mapping[str, str]) -> Finding:
    finding = Finding()
    before = await run.count()
    for what, value in keys.items():
        refused(finding, await run.send(value), 400, what)
    await run.effects_since(before, 0, finding)
    return finding


@suite.check(
    "key-empty",
    "an empty key names no operation: accepting it makes every such request one operation",
    f"{DRAFT}, Syntax (a non-empty sf-string) and Error Scenarios",
)
async def key_empty(run: HttpRun) -> Finding:
    return await refused_keys(run, {"an empty key": "", 'the sf-string ""': '""'})


@suite.check(
    "key-too-long",
    "keys over 255 characters are refused, not truncated (two keys would become one)",
    f"{STRIPE} (keys of up to 255 characters)",
)
async def key_too_long(run: HttpRun) -> Finding:
    return await refused_keys(run, {"a 256-character key": '"' + "k" * 256 + '"'})


@suite.check(
    "key-control-characters",
    "a key with control characters is not an sf-string and would corrupt logs and stores",
    f"{DRAFT}, Syntax; RFC 8941 §3.3.3 (sf-string: visible ASCII and space)",
)
async def key_control_characters(run: HttpRun) -> Finding:
    return await refused_keys(run, {"a key with a tab": '"conformance\tkey"'})


@suite.check(
    "key-structured-field",
    "the key is an RFC 8941 sf-string: escapes are decoded, a broken string is refused",
    f"{DRAFT}, Syntax; RFC 8941 §3.3.3",
)
async def key_structured_field(run: HttpRun) -> Finding:
    finding = Finding()
    before = await run.count()
    escaped = f'"conformance-\\"{uuid.uuid4().hex}\\""'
    first = await run.send(escaped)
    second = await run.send(escaped)
    finding.saw(f"escaped sf-string: {shown(first)}, retry {shown(second)}")
    finding.expect(first.is_success, f"a key with sf-string escapes answered {first.status_code}")
    finding.expect(
        second.content == first.content, "the retry with the escaped key was not a replay"
    )
    for what, value in {
        "an unterminated sf-string": '"conformance-open',
        "an sf-string with a bad escape": '"conformance\\x"',
    }.items():
        refused(finding, await run.send(value), 400, what)
    await run.effects_since(before, 1, finding)
    return finding


@suite.check(
    "replay-identical",
    "a retry gets the stored answer, byte for byte with the original status, and no new effect",
    f"{DRAFT}, Idempotency Enforcement; {STRIPE} (same status code and body)",
)
async def replay_identical(run: HttpRun) -> Finding:
    finding = Finding()
    first, second, effects = await run.first_pair()
    finding.saw(f"original {shown(first)}, retry {shown(second)}")
    finding.expect(
        second.status_code == first.status_code,
        f"the retry answered {second.status_code}, the original {first.status_code}",
    )
    finding.expect(second.content == first.content, "the retry's body differs from the original's")
    finding.expect(
        second.headers.get("content-type") == first.headers.get("content-type"),
        "the retry's Content-Type differs",
    )
    if run.replayed(second):
        finding.saw(f"retry marked {run.target.replay_header}: true")
    if effects is not None:
        finding.expect(effects == 1, f"effects +{effects} for one operation, not +1")
        if effects == 1:
            finding.saw("effects +1")
    return finding


@suite.check(
    "replay-keeps-location",
    "a replay points the client at the same created resource as the original",
    f"{DRAFT}, Idempotency Enforcement; RFC 9110 §10.2.2 (Location)",
)
async def replay_keeps_location(run: HttpRun) -> Finding:
    finding = Finding()
    first, second, _ = await run.first_pair()
    location = first.headers.get("location")
    if location is None:
        return finding.skip("the endpoint's answer carries no Location header")
    finding.saw(f"original Location {location}, retry {second.headers.get('location')}")
    finding.expect(second.headers.get("location") == location, "the replay's Location differs")
    return finding


@suite.check(
    "replay-drops-set-cookie",
    "a replay must not hand the original caller's session cookie to whoever retries",
    "RFC 6265 §8 (cookies carry credentials); pgonce replay rules",
)
async def replay_drops_set_cookie(run: HttpRun) -> Finding:
    finding = Finding()
    url = same_origin(run.target.url, run.target.cookie_path) if run.target.cookie_path else None
    key = new_key()
    first = await run.send(key, url=url)
    if "set-cookie" not in first.headers:
        return finding.skip(
            f"{shown(first)} without Set-Cookie: give --cookie-path, an endpoint that sets one"
        )
    second = await run.send(key, url=url)
    finding.saw(f"original {shown(first)} with Set-Cookie, retry {shown(second)}")
    finding.expect(second.content == first.content, "the retry was not a replay")
    finding.expect("set-cookie" not in second.headers, "the replay carries Set-Cookie")
    return finding


@suite.check(
    "key-lifetime-header",
    "the client learns how long the key is honoured, so it never retries after the store forgot",
    f"{DRAFT}, Idempotency Key Validity and Expiry; {STRIPE} (24 hours)",
)
async def key_lifetime_header(run: HttpRun) -> Finding:
    finding = Finding()
    first, second, _ = await run.first_pair()
    name = run.target.expires_header
    values = [first.headers.get(name), second.headers.get(name)]
    if not finding.expect(values[0] is not None, f"no {name} header on the original"):
        return finding
    finding.saw(f"{name}: {values[0]}")
    try:
        when = parsedate_to_datetime(values[0])
    except (TypeError, ValueError):
        when = None
    if finding.expect(when is not None, f"{name} is not an HTTP-date") and when is not None:
        finding.expect(when > datetime.now(UTC), f"{name} is in the past")
    finding.expect(values[1] == values[0], f"the replay's {name} differs from the original's")
    return finding


def other_body(target: HttpTarget) -> bytes | None:
    if target.other_body is not None:
        return target.other_body
    try:
        document = json.loads(target.body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    return json.dumps({**document, "conformance": "another request"}).encode()


@suite.check(
    "mismatch-other-body",
    "the same key with another body is a client bug: refused, never answered with the first reply",
    f"{DRAFT}, Idempotency Fingerprint and Error Scenarios (422); {STRIPE}",
)
async def mismatch_other_body(run: HttpRun) -> Finding:
    finding = Finding()
    body = other_body(run.target)
    if body is None:
        return finding.skip("the body is not a JSON object: give --other-body")
    return await mismatch(run, finding, body=body)


@suite.check(
    "mismatch-other-query",
    "the query string is part of the request: another query with the same key is refused",
    f"{DRAFT}, Idempotency Fingerprint and Error Scenarios (422)",
)
async def mismatch_other_query(run: HttpRun) -> Finding:
    url = str(httpx.URL(run.target.url).copy_merge_params({"conformance": "another-query"}))
    return await mismatch(run, Finding(), url=url)


async def mismatch(
    run: HttpRun, finding: Finding, *, body: bytes | None = None, url: str | None = None
) -> Finding:
    before = await run.count()
    key = new_key()
    first = await run.send(key)
    other = await run.send(key, body=body, url=url)
    refused(finding, other, 422, "the other request")
    finding.expect(other.content != first.content, "the other request got the original's answer")
    again = await run.send(key)
    finding.expect(again.content == first.content, "the original's retry no longer replays")
    await run.effects_since(before, 1, finding)
    return finding


def reformatted(body: bytes) -> bytes | None:
    """The same JSON value written differently (key order, spacing), or None if not JSON."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if isinstance(document, dict):
        document = dict(reversed(list(document.items())))
    other = json.dumps(document, indent=2, ensure_ascii=False).encode()
    return other if other != body else json.dumps(document, separators=(",", ":")).encode()


@suite.check(
    "canonical-json-same-request",
    "a client that re-serializes the same JSON (key order, spacing) is retrying, not changing it",
    f"{STRIPE} (parameters are compared, not bytes); {DRAFT}, Idempotency Fingerprint",
)
async def canonical_json(run: HttpRun) -> Finding:
    finding = Finding()
    other = reformatted(run.target.body)
    if other is None or other == run.target.body:
        return finding.skip("the body is not JSON that can be written another way")
    before = await run.count()
    key = new_key()
    first = await run.send(key)
    second = await run.send(key, body=other)
    finding.saw(f"original {shown(first)}, reformatted retry {shown(second)}")
    finding.expect(
        second.status_code == first.status_code and second.content == first.content,
        "the reformatted retry was not answered with the stored response",
    )
    await run.effects_since(before, 1, finding)
    return finding


async def burst(run: HttpRun) -> tuple[list[httpx.Response], int | None]:
    before = await run.count()
    key = new_key()
    answers = await asyncio.gather(*(run.send(key) for _ in range(run.target.concurrency)))
    after = await run.count()
    run.bursts.append(list(answers))
    return list(answers), None if before is None else (after or 0) - before


def statuses(answers: list[httpx.Response]) -> str:
    counted: dict[int, int] = {}
    for answer in answers:
        counted[answer.status_code] = counted.get(answer.status_code, 0) + 1
    return ", ".join(f"{n}× {status}" for status, n in sorted(counted.items()))


@suite.check(
    "concurrent-once",
    "identical requests racing each other (client retries, proxies) must execute once",
    f"{DRAFT}, Error Scenarios (concurrent requests); {STRIPE}",
)
async def concurrent_once(run: HttpRun) -> Finding:
    finding = Finding()
    answers, effects = await burst(run)
    finding.saw(f"{len(answers)} concurrent copies: {statuses(answers)}")
    succeeded = [a for a in answers if a.is_success]
    bodies = {a.content for a in succeeded}
    finding.expect(bool(succeeded), "no copy succeeded")
    finding.expect(len(bodies) <= 1, f"{len(bodies)} different successful bodies")
    others = [a for a in answers if not a.is_success and a.status_code != 409]
    finding.expect(not others, f"answers other than 2xx or 409: {statuses(others)}")
    if effects is None:
        if not finding.faults:
            return finding.skip(
                f"{finding.seen[0]}; effects not counted: give --count-url or --count-sql"
            )
        return finding
    finding.expect(effects == 1, f"effects +{effects}, not +1")
    if effects == 1:
        finding.saw("effects +1")
    return finding


@suite.check(
    "in-flight-409",
    "a retry while the original still runs is told to come back later, never run twice",
    f"{DRAFT}, Error Scenarios (409); RFC 9110 §10.2.3 (Retry-After); RFC 9457",
)
async def in_flight_409(run: HttpRun) -> Finding:
    finding = Finding()
    if run.target.slow_path is not None:
        conflicts = await while_in_flight(run, finding)
    else:
        conflicts = [a for answers in run.bursts for a in answers if a.status_code == 409]
        seen = sum(len(answers) for answers in run.bursts)
        if not conflicts:
            return finding.skip(
                f"none of {seen} concurrent copies arrived while its original ran: give "
                "--slow-path, an endpoint that takes a while"
            )
        finding.saw(f"{len(conflicts)} of {seen} concurrent copies answered 409")
    without = [a for a in conflicts if not a.headers.get("retry-after", "").strip()]
    finding.expect(not without, f"{len(without)} of the 409s carry no Retry-After")
    plain = [a for a in conflicts if not is_problem(a)]
    finding.expect(not plain, f"{len(plain)} of the 409s are not application/problem+json")
    return finding


async def while_in_flight(run: HttpRun, finding: Finding) -> list[httpx.Response]:
    """Send a slow request and, while it runs, its retry; then retry once more after both.

    Whichever of the two the server claimed first is the original: the other must be the 409
    (so a loaded machine that delays the first request cannot turn the verdict around).
    """
    assert run.target.slow_path is not None
    url = same_origin(run.target.url, run.target.slow_path)
    key = new_key()
    before = await run.count()
    original = asyncio.ensure_future(run.send(key, url=url))
    # Let the original reach the server first; the retry then arrives while it still runs.
    await asyncio.wait({original}, timeout=0.2)
    retry = await run.send(key, url=url)
    first = await original
    after = await run.send(key, url=url)
    finding.saw(f"original {shown(first)}, retry while it ran {shown(retry)}")
    finding.saw(f"retry after it {shown(after)}")
    answers = [first, retry]
    conflicts = [a for a in answers if a.status_code == 409]
    done = [a for a in answers if a.is_success]
    finding.expect(
        len(conflicts) == 1 and len(done) == 1,
        "one of the two should have run and the other answered 409; they answered "
        f"{first.status_code} and {retry.status_code}",
    )
    if done:
        finding.expect(after.content == done[0].content, "the retry after it was not a replay")
    await run.effects_since(before, 1, finding)
    return conflicts


@suite.check(
    "server-error-not-stored",
    "a 5xx is a transient failure: storing it would turn one outage into a permanent error",
    "pgonce semantics (a 5xx is rolled back and the key stays free; Stripe stores them)",
)
async def server_error_not_stored(run: HttpRun) -> Finding:
    finding = Finding()
    if run.target.fail_path is None:
        return finding.skip("give --fail-path, an endpoint that answers 5xx")
    url = same_origin(run.target.url, run.target.fail_path)
    before = await run.count()
    key = new_key()
    first = await run.send(key, url=url)
    second = await run.send(key, url=url)
    finding.saw(f"original {shown(first)}, retry {shown(second)}")
    if not finding.expect(first.status_code >= 500, "the --fail-path did not answer 5xx"):
        return finding
    finding.expect(
        not run.replayed(second),
        f"the retry of a 5xx was replayed ({run.target.replay_header}: true)",
    )
    if second.content != first.content:
        finding.saw("the retry ran again (another body)")
    await run.effects_since(before, 0, finding)
    return finding


@suite.check(
    "principal-scopes",
    "keys belong to a caller: another caller's equal key is another operation, never a replay",
    f"{DRAFT}, Uniqueness of Idempotency Key; {STRIPE} (keys are per account)",
)
async def principal_scopes(run: HttpRun) -> Finding:
    finding = Finding()
    if run.target.other_headers is None:
        return finding.skip("give --other-header, the credentials of another caller")
    before = await run.count()
    key = new_key()
    first = await run.send(key)
    other = await run.send(key, headers=run.target.other_headers)
    finding.saw(f"first caller {shown(first)}, second caller {shown(other)}")
    finding.expect(other.is_success, f"the second caller's request answered {other.status_code}")
    finding.expect(not run.replayed(other), "the second caller got a replay")
    finding.expect(other.content != first.content, "the second caller got the first one's answer")
    await run.effects_since(before, 2, finding)
    return finding


@suite.check(
    "body-too-large-413",
    "the body is read whole to fingerprint it: an unbounded one is a memory attack",
    "RFC 9110 §15.5.14 (413 Content Too Large); RFC 9457",
)
async def body_too_large(run: HttpRun) -> Finding:
    finding = Finding()
    size = run.target.max_body_bytes + 1
    padding = "x" * max(0, size - len('{"conformance":""}'))
    body = json.dumps({"conformance": padding}, separators=(",", ":")).encode()
    before = await run.count()
    refused(finding, await run.send(new_key(), body=body), 413, f"a body of {digest(body)}")
    await run.effects_since(before, 0, finding)
    return finding


@suite.check(
    "safe-methods-untouched",
    "GET is idempotent by definition: a key on it is neither refused nor replayed",
    "RFC 9110 §9.2.1 (safe methods); " + DRAFT + ", Introduction",
)
async def safe_methods_untouched(run: HttpRun) -> Finding:
    finding = Finding()
    url = same_origin(run.target.url, run.target.safe_path) if run.target.safe_path else None
    before = await run.count()
    bad = await run.send("", url=url, method="GET")
    key = new_key()
    first = await run.send(key, url=url, method="GET")
    second = await run.send(key, url=url, method="GET")
    finding.saw(f"GET with an empty key {shown(bad)}; GET twice with a key {shown(second)}")
    finding.expect(
        bad.status_code not in (400, 409, 422), f"GET with an empty key answered {bad.status_code}"
    )
    finding.expect(not run.replayed(second), "the second GET was marked as a replay")
    finding.expect(first.status_code == second.status_code, "the two GETs answered differently")
    await run.effects_since(before, 0, finding)
    return finding


async def check_http(
    target: HttpTarget,
    *,
    effects: Effects | None = None,
    budget: float = DEFAULT_BUDGET,
    only: tuple[str, ...] = (),
    http: httpx.AsyncClient | None = None,
) -> Report:
    """Run the HTTP checks against ``target``; ``effects`` counts what really happened.

    Raises :class:`~pgonce.errors.UsageError` when the endpoint cannot be judged at all: it is
    unreachable, or the request the kit was given does not succeed with a new key.
    """
    async with contextlib.AsyncExitStack() as stack:
        session = http if http is not None else await stack.enter_async_context(client())
        run = HttpRun(target, session, effects)
        try:
            first = await run.send(new_key())
        except httpx.HTTPError as error:
            raise UsageError(f"cannot reach {target.url}: {error}") from None
        if not first.is_success:
            raise UsageError(
                f"{target.method} {target.url} with a new key answered {first.status_code}, not "
                "2xx: give the --body and --header that the endpoint accepts"
            )
        await run.count()  # the count contract holds before anything is judged
        return await suite.run(run, target.url, budget=budget, only=only)
