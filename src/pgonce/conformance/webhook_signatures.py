"""The checks of signatures: the provider's are accepted, any other is refused (401, 400, 403)."""

from __future__ import annotations

import base64
import contextlib
import secrets as random_secrets
from datetime import UTC, datetime, timedelta

from pgonce.conformance.providers import provider_signer
from pgonce.conformance.report import Finding, digest
from pgonce.conformance.runner import answered, shown
from pgonce.conformance.webhook_run import (
    GITHUB,
    SIGNATURE_REFUSED,
    SLACK,
    STANDARD,
    STRIPE,
    WebhookRun,
    WebhookTarget,
    suite,
)
from pgonce.errors import ConfigError, UsageError
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.schemes.base import SigningScheme


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
    finding.expect(response.is_success, answered("a validly signed delivery", response))
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
    finding.expect(response.is_success, answered(f"{signer.library}'s delivery", response))
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
    finding.saw(f"slowest of {len(run.ack_times)} acknowledgements: {slowest * 1000:.0f} ms")
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
    run.refused(
        finding, await run.post(body, headers), SIGNATURE_REFUSED, "signed with another secret"
    )
    _, other = run.new_event()
    moved = run.sign(other, event_id)  # a genuine signature, of other bytes
    run.refused(finding, await run.post(body, moved), SIGNATURE_REFUSED, "another body's signature")
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
    run.refused(finding, await run.post(body, headers), SIGNATURE_REFUSED, "no signature header")
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
        run.refused(
            finding, await run.post(body, headers), SIGNATURE_REFUSED, f"signature {garbage!r}"
        )
    return finding


async def out_of_tolerance(run: WebhookRun, shift: timedelta, what: str) -> Finding:
    finding = Finding()
    if not run.signs_time():
        return finding.skip(f"the {run.target.scheme} scheme signs no timestamp")
    event_id, body = run.new_event()
    moment = datetime.now(UTC) + shift
    headers = run.sign(body, event_id, at=moment)
    run.refused(finding, await run.post(body, headers), SIGNATURE_REFUSED, what)
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
