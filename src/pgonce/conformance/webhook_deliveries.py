"""The checks of deliveries: bad bodies, limits, sources, reused ids, storms, refusals."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit, urlunsplit

# The signature checks register (and so run) first.
from pgonce.conformance import webhook_signatures  # noqa: F401
from pgonce.conformance.report import Finding, digest
from pgonce.conformance.runner import (
    CLOSED,
    RATE_LIMIT_RETRIES,
    answered,
    closed_on,
    is_problem,
    pause,
    reached,
    server_failed,
    shown,
    statuses,
)
from pgonce.conformance.webhook_run import (
    GITHUB,
    STANDARD,
    STRIPE,
    WebhookRun,
    event_body,
    suite,
)
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx


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
    try:
        answer = await run.post(body, headers)
    except CLOSED as error:
        finding.saw(closed_on(f"a body of {digest(body)}", error))
    else:
        run.refused(finding, answer, 413, f"a body of {digest(body)}")
    return finding


def sibling(url: str) -> str | None:
    """The endpoint's URL with its last path segment replaced by a name no source has; its
    query is kept (a ``?token=`` that lets the delivery past a proxy or a gateway must reach
    the receiver, or the check judges the gateway's refusal instead of the receiver's)."""
    parts = urlsplit(url)
    head, sep, last = parts.path.rstrip("/").rpartition("/")
    if not sep or not last:
        return None
    path = f"{head}/conformance-unknown-{uuid.uuid4().hex[:8]}"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


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
    finding.expect(first.is_success, answered("the original delivery", first))
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
    storms: list[list[httpx.Response]] = []
    while True:
        # Each copy signed anew, as a provider's redelivery is; not patient: a copy sent again
        # after a 429 would no longer be part of the storm.
        copies = (
            run.post(body, run.sign(body, event_id), patient=False)
            for _ in range(run.target.copies)
        )
        answers = await asyncio.gather(*copies)
        storms.append(answers)
        taken = reached(answers)
        # A storm needs two copies past the rate limiting, one of them acknowledged.
        if len(taken) == len(answers) or stormed(taken):
            break
        wait = pause(next(a for a in answers if a.status_code == 429))
        if wait is None or len(storms) > RATE_LIMIT_RETRIES:
            break
        # The same event again, as a provider sends a delivery refused 429 again.
        await asyncio.sleep(wait)
    every = [answer for answers in storms for answer in answers]
    judged = reached(every)
    finding.saw(f"{len(answers)} copies: {statuses(answers)}")
    if len(storms) > 1:
        earlier = [answer for answers in storms[:-1] for answer in answers]
        more = len(storms) - 1
        finding.saw(
            f"the storm sent {more} more time{'s' if more != 1 else ''} after its Retry-After, "
            f"its earlier copies: {statuses(earlier)}"
        )
    if limited := len(every) - len(judged):
        finding.saw(
            f"{limited} rate limited (429 Too Many Requests): neither acknowledged nor judged"
        )
    failed = sum(server_failed(a) for a in judged)
    finding.expect(
        all(a.is_success for a in judged),
        ("not every copy past the rate limiting" if limited else "not every copy")
        + " was acknowledged"
        + (f" ({failed} answered 5xx, a server failure)" if failed else ""),
    )
    if before is not None:
        await run.one_effect(before, finding, any(a.is_success for a in judged))
    if not stormed(taken) and not finding.faults:
        return finding.skip(
            f"not decided: only {len(taken)} of {len(answers)} copies got past the rate limiting "
            "(429 Too Many Requests), too few for a storm: run the kit where the receiver is not "
            "rate limited, or with fewer --copies; " + "; ".join(finding.seen)
        )
    if before is None and not finding.faults:
        return finding.skip(
            f"{'; '.join(finding.seen)}; effects not counted: give --count-url or --count-sql"
        )
    return finding


def stormed(taken: list[httpx.Response]) -> bool:
    """Whether the copies past the rate limiting make a storm: two, one acknowledged."""
    return len(taken) >= 2 and any(a.is_success for a in taken)


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
        if run.failures:
            # The server failed where a refusal was expected: those checks fail, saying so.
            return finding.skip(
                f"no delivery was refused: the server failed (5xx) on {len(run.failures)} "
                "that it should have refused"
            )
        return finding.skip("no delivery was refused")
    plain = [what for what, response in run.refusals if not is_problem(response)]
    finding.saw(
        f"{len(run.refusals) - len(plain)} of {len(run.refusals)} refusals are problem+json"
    )
    finding.expect(not plain, "not application/problem+json: " + ", ".join(plain))
    return finding
