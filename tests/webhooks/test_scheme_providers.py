"""Our verifiers against the providers' own signers, and our signers against their verifiers.

The libraries are dev dependencies only: ``standardwebhooks`` (Webhook.sign/verify), ``stripe``
(WebhookSignature.generate_signature_header/verify_header) and ``slack_sdk``
(SignatureVerifier.generate_signature/is_valid). Their verifiers read the real clock, so these
tests sign with the current time.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import standardwebhooks
import stripe
from slack_sdk.signature import SignatureVerifier

from pgonce.errors import SignatureInvalid, TimestampOutOfTolerance
from pgonce.webhooks.schemes import build_scheme

SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
STRIPE_SECRET = "whsec_test_secret"
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"

BODIES = [
    b'{"type":"user.created","data":{"id":"u_1","name":"Zo\xc3\xab \xe2\x9c\x93"}}',
    b"{}",
    b"",
    json.dumps({"text": "x" * 70_000}).encode(),
]


def now() -> datetime:
    return datetime.now(UTC)


@pytest.mark.parametrize("body", BODIES)
def test_standardwebhooks_signer_is_accepted(body: bytes) -> None:
    moment = now()
    signature = standardwebhooks.Webhook(SW_SECRET).sign("msg_p1", moment, body.decode())
    headers = {
        "webhook-id": "msg_p1",
        "webhook-timestamp": str(int(moment.timestamp())),
        "webhook-signature": signature,
    }
    scheme = build_scheme("standard-webhooks", [SW_SECRET])
    scheme.verify(headers, body, now=moment)
    assert scheme.event_id(headers, body) == "msg_p1"


@pytest.mark.parametrize("body", BODIES)
def test_our_standard_webhooks_signature_passes_the_reference_verifier(body: bytes) -> None:
    headers = build_scheme("standard-webhooks", [SW_SECRET]).sign(body, event_id="msg_p2")
    standardwebhooks.Webhook(SW_SECRET).verify(body, headers, json_parse=False)


def test_reference_verifier_rejects_what_we_reject() -> None:
    headers = build_scheme("standard-webhooks", [SW_SECRET]).sign(b"{}", event_id="msg_p3")
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(SW_SECRET).verify(b"{ }", headers, json_parse=False)
    with pytest.raises(SignatureInvalid):
        build_scheme("standard-webhooks", [SW_SECRET]).verify(headers, b"{ }", now=now())


def test_non_utf8_body_is_a_verification_result_not_a_crash() -> None:
    # The reference package raises UnicodeDecodeError here; we answer with a WebhookError, or
    # accept the authentic bytes (a body does not have to be text to be signed).
    body = b"\xff\xfe\x00binary"
    scheme = build_scheme("standard-webhooks", [SW_SECRET])
    with pytest.raises(UnicodeDecodeError):
        standardwebhooks.Webhook(SW_SECRET).verify(body, scheme.sign(b"x"), json_parse=False)
    headers = scheme.sign(body, event_id="msg_bin")
    scheme.verify(headers, body, now=now())
    with pytest.raises(SignatureInvalid):
        scheme.verify(scheme.sign(b"x", event_id="msg_bin"), body, now=now())


def stripe_event(event_id: str) -> bytes:
    return json.dumps({"id": event_id, "object": "event", "type": "charge.succeeded"}).encode()


@pytest.mark.parametrize("event_id", ["evt_1", "evt_\u00e9t\u00e9"])
def test_stripe_library_header_is_accepted(event_id: str) -> None:
    body = stripe_event(event_id)
    moment = now()
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), STRIPE_SECRET, int(moment.timestamp())
    )
    scheme = build_scheme("stripe", [STRIPE_SECRET])
    scheme.verify({"stripe-signature": header}, body, now=moment)
    assert scheme.event_id({"stripe-signature": header}, body) == event_id


def test_our_stripe_header_passes_the_stripe_library() -> None:
    body = stripe_event("evt_2")
    headers = build_scheme("stripe", [STRIPE_SECRET]).sign(body)
    assert stripe.WebhookSignature.verify_header(
        body, headers["stripe-signature"], STRIPE_SECRET, tolerance=300
    )


def test_stripe_key_is_the_whole_secret_not_its_base64() -> None:
    # Verified with a Standard Webhooks scheme holding the same whsec_ string, the Stripe header
    # must fail: the two conventions really differ.
    body = stripe_event("evt_3")
    moment = now()
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD", int(moment.timestamp())
    )
    build_scheme("stripe", ["whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"]).verify(
        {"stripe-signature": header}, body, now=moment
    )
    with pytest.raises(SignatureInvalid):
        build_scheme("stripe", ["C2FVsBQIhrscChlQIMV+b5sSYspob7oD"]).verify(
            {"stripe-signature": header}, body, now=moment
        )


def test_stripe_future_timestamp_refused_although_the_stripe_library_accepts_it() -> None:
    body = stripe_event("evt_4")
    future = now() + timedelta(hours=1)
    header = stripe.WebhookSignature.generate_signature_header(
        body.decode(), STRIPE_SECRET, int(future.timestamp())
    )
    assert stripe.WebhookSignature.verify_header(body, header, STRIPE_SECRET, tolerance=300)
    with pytest.raises(TimestampOutOfTolerance):
        build_scheme("stripe", [STRIPE_SECRET]).verify(
            {"stripe-signature": header}, body, now=now()
        )


def test_stripe_several_v1_entries_during_a_roll() -> None:
    body = stripe_event("evt_5")
    moment = now()
    t = int(moment.timestamp())
    old = stripe.WebhookSignature.generate_signature_header(body.decode(), "whsec_old", t)
    new = stripe.WebhookSignature.generate_signature_header(body.decode(), STRIPE_SECRET, t)
    legacy = "v0=6ffbb59b2300aae63f272406069a9788598b792a944a07aba816edb039989a39"
    both = f"{new},{old.split(',')[1]},{legacy}"
    build_scheme("stripe", [STRIPE_SECRET]).verify({"stripe-signature": both}, body, now=moment)
    build_scheme("stripe", ["whsec_old"]).verify({"stripe-signature": both}, body, now=moment)


@pytest.mark.parametrize(
    "body",
    [b'{"event_id":"Ev0PV52K21","type":"event_callback"}', b"payload=%7B%7D", b""],
)
def test_slack_sdk_signature_is_accepted(body: bytes) -> None:
    moment = now()
    timestamp = str(int(moment.timestamp()))
    signature = SignatureVerifier(SLACK_SECRET).generate_signature(timestamp=timestamp, body=body)
    assert signature is not None
    headers = {"x-slack-signature": signature, "x-slack-request-timestamp": timestamp}
    scheme = build_scheme("slack", [SLACK_SECRET])
    scheme.verify(headers, body, now=moment)
    expected = "Ev0PV52K21" if body.startswith(b"{") else None
    assert scheme.event_id(headers, body) == expected


def test_our_slack_signature_passes_slack_sdk() -> None:
    body = b'{"event_id":"Ev1","type":"event_callback"}'
    headers = build_scheme("slack", [SLACK_SECRET]).sign(body)
    assert SignatureVerifier(SLACK_SECRET).is_valid_request(body, headers)
