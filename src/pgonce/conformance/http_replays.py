"""The checks of what a key does: replays, mismatches, races, failures, scopes and limits."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# The key checks register (and so run) first.
from pgonce.conformance import http_keys  # noqa: F401
from pgonce.conformance.http_run import (
    DRAFT,
    STRIPE,
    HttpRun,
    HttpTarget,
    new_key,
    refused,
    same_origin,
    suite,
)
from pgonce.conformance.report import Finding, digest
from pgonce.conformance.runner import (
    CLOSED,
    RATE_LIMIT_RETRIES,
    RateLimited,
    answered,
    closed_on,
    is_problem,
    pause,
    reached,
    server_failed,
    shown,
    statuses,
)
from pgonce.core.urls import public
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx


@suite.check(
    "replay-identical",
    "a retry gets the stored answer, byte for byte with the original status, and no new effect",
    f"{DRAFT}, Idempotency Enforcement; {STRIPE} (same status code and body)",
)
async def replay_identical(run: HttpRun) -> Finding:
    finding = Finding()
    first, second, effects = await run.first_pair()
    finding.saw(f"original {shown(first)}, retry {shown(second)}")
    # Two equal refusals (a rate limiter, an outage) are no replay of anything.
    finding.expect(first.is_success, answered("the original", first, "2xx"))
    finding.expect(
        second.status_code == first.status_code,
        f"{answered('the retry', second)}, the original {first.status_code}",
    )
    finding.expect(second.content == first.content, "the retry's body differs from the original's")
    finding.expect(
        second.headers.get("content-type") == first.headers.get("content-type"),
        "the retry's Content-Type differs",
    )
    # A new key's answer marked as a replay tells the client its request did not run: a lie
    # that makes a careful client look for an earlier request that never was.
    finding.expect(
        not run.replayed(first),
        f"the original, with a new key, is marked {run.target.replay_header}: true",
    )
    if run.replayed(second):
        finding.saw(f"retry marked {run.target.replay_header}: true")
    if effects is not None:
        finding.expect(effects == 1, f"effects +{effects} for one operation, not +1")
        if effects == 1:
            finding.saw("effects +1")
    return finding


def unjudged(original: httpx.Response) -> str:
    """Why a check of the original's headers has nothing to judge: the original failed (its
    headers are the failure's, not the endpoint's answer); replay-identical fails for it."""
    return f"{answered('the original', original, '2xx')}: nothing to judge (see replay-identical)"


@suite.check(
    "replay-keeps-location",
    "a replay points the client at the same created resource as the original",
    f"{DRAFT}, Idempotency Enforcement; RFC 9110 §10.2.2 (Location)",
)
async def replay_keeps_location(run: HttpRun) -> Finding:
    finding = Finding()
    first, second, _ = await run.first_pair()
    if not first.is_success:
        return finding.skip(unjudged(first))
    location = first.headers.get("location")
    if location is None:
        return finding.skip("the endpoint's answer carries no Location header")
    again = second.headers.get("location")
    finding.saw(f"original Location {public(location)}, retry {public(again or '(none)')}")
    finding.expect(again == location, "the replay's Location differs")
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
    if not first.is_success:
        return finding.skip(unjudged(first))
    name = run.target.expires_header
    values = [first.headers.get(name), second.headers.get(name)]
    if values[0] is None:
        # The draft defines no such header: the lifetime may be a documented policy only.
        return finding.skip(f"no {name} header (the draft asks for a documented policy only)")
    finding.saw(f"{name}: {values[0]}")
    try:
        when = parsedate_to_datetime(values[0])
    except (TypeError, ValueError):
        when = None
    if when is not None and when.tzinfo is None:
        # The asctime form (and "-0000") carries no zone: an HTTP-date is always UTC.
        when = when.replace(tzinfo=UTC)
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
    if not first.is_success:
        # No stored answer to compare with: two equal failures are not "the original's answer".
        finding.saw(f"original {shown(first)}, the other request {shown(other)}")
        finding.expect(False, answered("the original", first, "2xx"))
        return finding
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
    "the same JSON re-serialized (key order, spacing) is replayed or refused, never run again",
    f"{STRIPE} (parameters are compared, not bytes); {DRAFT}, Idempotency Fingerprint (any "
    "digest of the payload)",
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
    finding.expect(first.is_success, answered("the original", first, "2xx"))
    if second.status_code == 422 and is_problem(second):
        # The draft lets the fingerprint be any digest of the payload, its raw bytes included:
        # refusing the other bytes as another request is allowed; running it again is not.
        finding.saw("refused as another request (a fingerprint of the bytes)")
    else:
        finding.expect(
            second.status_code == first.status_code and second.content == first.content,
            "the reformatted retry was neither answered with the stored response nor refused "
            "with a 422 problem",
        )
    await run.effects_since(before, 1, finding)
    return finding


async def burst(run: HttpRun) -> tuple[list[httpx.Response], int | None]:
    before = await run.count()
    key = new_key()
    # Not patient: a copy sent again after a 429 would no longer race the others.
    copies = (run.send(key, patient=False) for _ in range(run.target.concurrency))
    answers = await asyncio.gather(*copies)
    after = await run.count()
    run.bursts.append(list(answers))
    return list(answers), None if before is None else (after or 0) - before


@suite.check(
    "concurrent-once",
    "identical requests racing each other (client retries, proxies) must execute once",
    f"{DRAFT}, Error Scenarios (concurrent requests); {STRIPE}",
)
async def concurrent_once(run: HttpRun) -> Finding:
    finding = Finding()
    tries = 0
    while True:
        answers, effects = await burst(run)
        raced = reached(answers)
        limited = len(answers) - len(raced)
        # A race needs two copies past the rate limiting, one of them executed.
        if not limited or (len(raced) >= 2 and any(a.is_success for a in raced)):
            break
        wait = pause(next(a for a in answers if a.status_code == 429))
        if effects is not None and effects > 1:
            wait = None  # judged below: two effects are two executions, 429s or not
        if wait is None or tries == RATE_LIMIT_RETRIES:
            break
        await asyncio.sleep(wait)
        tries += 1
    finding.saw(f"{len(answers)} concurrent copies: {statuses(answers)}")
    if limited:
        again = f", the burst sent {tries} more time{'s' if tries != 1 else ''}" if tries else ""
        finding.saw(
            f"{limited} rate limited (429 Too Many Requests): neither executed nor judged{again}"
        )
    if limited and (len(raced) < 2 or not any(a.is_success for a in raced)):
        if effects is not None:
            finding.expect(effects <= 1, f"effects +{effects} for one operation, not at most +1")
        if finding.faults:
            return finding
        waited = f" after {tries} wait{'s' if tries != 1 else ''} for its Retry-After"
        return finding.skip(
            f"not decided: only {len(raced)} of {len(answers)} copies got past the rate "
            f"limiting (429 Too Many Requests){waited if tries else ''}, too few for a race: run "
            f"the kit where the endpoint is not rate limited, or with a lower --concurrency; "
            + "; ".join(finding.seen)
        )
    succeeded = [a for a in raced if a.is_success]
    bodies = {a.content for a in succeeded}
    finding.expect(bool(succeeded), "no copy succeeded")
    finding.expect(len(bodies) <= 1, f"{len(bodies)} different successful bodies")
    others = [a for a in raced if not a.is_success and a.status_code != 409]
    failed = sum(server_failed(a) for a in others)
    finding.expect(
        not others,
        f"answers other than 2xx, 409 or 429: {statuses(others)}"
        + (f" ({failed} of them server failures)" if failed else ""),
    )
    if effects is None:
        if not finding.faults:
            return finding.skip(
                f"{'; '.join(finding.seen)}; effects not counted: give --count-url or --count-sql"
            )
        return finding
    finding.expect(effects == 1, f"effects +{effects}, not +1")
    if effects == 1:
        finding.saw("effects +1")
    return finding


@suite.check(
    "in-flight-409",
    "a retry while the original still runs is told to come back later (or waits), never run twice",
    f"{DRAFT}, Error Scenarios (409); RFC 9110 §10.2.3 (Retry-After); RFC 9457",
)
async def in_flight_409(run: HttpRun) -> Finding:
    finding = Finding()
    if run.target.slow_path is not None:
        conflicts = await while_in_flight(run, finding)
        if finding.skipped is not None:
            return finding
    else:
        conflicts = [a for answers in run.bursts for a in answers if a.status_code == 409]
        # Copies the rate limiting refused (429) never reached the endpoint.
        seen = sum(len(reached(answers)) for answers in run.bursts)
        if not seen:
            return finding.skip(
                "no concurrent copies were answered (see concurrent-once): give --slow-path, an "
                "endpoint that takes a while"
            )
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
    # Not patient: sent again after a 429, it would no longer arrive while the original runs.
    retry = await run.send(key, url=url, patient=False)
    if retry.status_code == 429:
        await original
        raise RateLimited("the retry while the original ran", retry, 0)
    first = await original
    after = await run.send(key, url=url)
    finding.saw(f"original {shown(first)}, retry while it ran {shown(retry)}")
    finding.saw(f"retry after it {shown(after)}")
    answers = [first, retry]
    conflicts = [a for a in answers if a.status_code == 409]
    done = [a for a in answers if a.is_success]
    waited = len(done) == 2 and first.content == retry.content
    if waited:
        # The draft's 409 is a SHOULD: a retry that waits for the original and is answered with
        # its stored response is as safe, provided it did not run again (the count, or the
        # replay marker, tells the two apart).
        if before is None and not any(run.replayed(a) for a in answers):
            finding.skip(
                "the retry waited and got the original's answer; whether it ran again needs "
                "--count-url or --count-sql"
            )
            return conflicts
        finding.saw("the retry waited for the original and was answered with its response")
    finding.expect(
        waited or (len(conflicts) == 1 and len(done) == 1),
        "one of the two should have run and the other answered 409 (or waited and replayed); "
        f"they answered {first.status_code} and {retry.status_code}"
        + (", a server failure" if server_failed(first) or server_failed(retry) else ""),
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
    if not finding.expect(first.is_success, answered("the first caller's request", first, "2xx")):
        return finding
    finding.expect(other.is_success, answered("the second caller's request", other))
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
    try:
        answer = await run.send(new_key(), body=body)
    except CLOSED as error:
        finding.saw(closed_on(f"a body of {digest(body)}", error))
    else:
        refused(finding, answer, 413, f"a body of {digest(body)}")
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
    for what, answer in (("GET with an empty key", bad), ("GET with a key", second)):
        # Two equal 500s are no sign that the key was left alone: the server failed.
        finding.expect(not server_failed(answer), answered(what, answer))
    finding.expect(not run.replayed(second), "the second GET was marked as a replay")
    finding.expect(first.status_code == second.status_code, "the two GETs answered differently")
    await run.effects_since(before, 0, finding)
    return finding
