"""Each scheme against the vectors its provider publishes (/work/shared/vectors, the docs)."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime, timedelta

import pytest

from pgonce.errors import SignatureInvalid
from pgonce.webhooks.schemes import build_scheme, delivery_event_id

# Standard Webhooks, from the reference libraries' tests.
SW_SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
SW_ID = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"
SW_TIMESTAMP = "1649367553"
SW_BODY = b'{"email":"test@example.com","username":"test_user"}'
SW_SIGNATURE = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
SW_WRONG = "v1,R3PTzyfHASBKHH98a7yexTwaJ4yNIcGhFQc1yuN+BPU="
SW_NOW = datetime.fromtimestamp(int(SW_TIMESTAMP), UTC)

# GitHub, from "Validating webhook deliveries".
GH_SECRET = "It's a Secret to Everybody"
GH_BODY = b"Hello, World!"
GH_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"

# Slack, from "Verifying requests from Slack" (a slash command's form body).
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
SLACK_TIMESTAMP = "1531420618"
SLACK_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V"
    b"&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text="
    b"&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmib"
    b"IGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)
SLACK_SIGNATURE = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"


def sw_headers(signature: str) -> dict[str, str]:
    return {"webhook-id": SW_ID, "webhook-timestamp": SW_TIMESTAMP, "webhook-signature": signature}


def test_standard_webhooks_vector_passes_and_names_its_event() -> None:
    scheme = build_scheme("standard-webhooks", [SW_SECRET])
    scheme.verify(sw_headers(SW_SIGNATURE), SW_BODY, now=SW_NOW)
    assert delivery_event_id(scheme, sw_headers(SW_SIGNATURE), SW_BODY) == SW_ID


def test_standard_webhooks_signer_reproduces_the_vector() -> None:
    scheme = build_scheme("standard-webhooks", [SW_SECRET])
    assert scheme.sign(SW_BODY, event_id=SW_ID, timestamp=SW_NOW) == sw_headers(SW_SIGNATURE)


@pytest.mark.parametrize(
    "signature",
    [
        SW_WRONG,
        "v1,",
        SW_SIGNATURE[:-1],  # the padding dropped: not canonical base64
        SW_SIGNATURE[:-2] + "=",  # truncated
        SW_SIGNATURE[:20],  # truncated further
        "v2," + SW_SIGNATURE[3:],  # an unknown version is never taken for v1
        SW_SIGNATURE.replace(",", ""),  # no comma
        "v1a," + SW_SIGNATURE[3:],  # an HMAC presented as an Ed25519 signature
        f"{SW_WRONG} {SW_WRONG}",
    ],
)
def test_standard_webhooks_must_fail(signature: str) -> None:
    scheme = build_scheme("standard-webhooks", [SW_SECRET])
    with pytest.raises(SignatureInvalid):
        scheme.verify(sw_headers(signature), SW_BODY, now=SW_NOW)


@pytest.mark.parametrize(
    "signature",
    [
        f"{SW_WRONG} {SW_SIGNATURE}",
        f"{SW_SIGNATURE} {SW_WRONG}",
        f"v1, v1a,AAAA v2,xyz nonsense {SW_SIGNATURE}",
        f"{SW_WRONG}, {SW_SIGNATURE}",  # two webhook-signature headers joined with ", "
    ],
)
def test_standard_webhooks_list_with_one_valid_entry_passes(signature: str) -> None:
    build_scheme("standard-webhooks", [SW_SECRET]).verify(
        sw_headers(signature), SW_BODY, now=SW_NOW
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("webhook-id", SW_ID + "x"), ("webhook-timestamp", str(int(SW_TIMESTAMP) + 1))],
)
def test_standard_webhooks_signature_covers_id_and_timestamp(field: str, value: str) -> None:
    headers = sw_headers(SW_SIGNATURE) | {field: value}
    with pytest.raises(SignatureInvalid):
        build_scheme("standard-webhooks", [SW_SECRET]).verify(headers, SW_BODY, now=SW_NOW)


def test_standard_webhooks_signature_covers_the_body() -> None:
    with pytest.raises(SignatureInvalid):
        build_scheme("standard-webhooks", [SW_SECRET]).verify(
            sw_headers(SW_SIGNATURE), SW_BODY + b" ", now=SW_NOW
        )


def test_github_vector() -> None:
    scheme = build_scheme("github", [GH_SECRET])
    headers = {"x-hub-signature-256": GH_SIGNATURE, "x-github-delivery": "72d3162e-cc78"}
    scheme.verify(headers, GH_BODY, now=datetime.now(UTC))
    assert scheme.event_id(headers, GH_BODY) == "72d3162e-cc78"
    assert scheme.sign(GH_BODY, event_id="72d3162e-cc78") == headers


@pytest.mark.parametrize(
    "signature",
    [
        GH_SIGNATURE[:-1],
        GH_SIGNATURE[:-2],
        GH_SIGNATURE.removeprefix("sha256="),
        "sha1=" + GH_SIGNATURE.removeprefix("sha256="),
        GH_SIGNATURE[:-1] + "0",
        "sha256=",
    ],
)
def test_github_must_fail(signature: str) -> None:
    with pytest.raises(SignatureInvalid):
        build_scheme("github", [GH_SECRET]).verify(
            {"x-hub-signature-256": signature}, GH_BODY, now=datetime.now(UTC)
        )


def test_github_accepts_upper_case_hex() -> None:
    upper = "sha256=" + GH_SIGNATURE.removeprefix("sha256=").upper()
    build_scheme("github", [GH_SECRET]).verify(
        {"x-hub-signature-256": upper}, GH_BODY, now=datetime.now(UTC)
    )


def test_github_has_no_timestamp_so_age_does_not_matter() -> None:
    long_after = datetime(2100, 1, 1, tzinfo=UTC)
    build_scheme("github", [GH_SECRET], tolerance=1).verify(
        {"x-hub-signature-256": GH_SIGNATURE}, GH_BODY, now=long_after
    )


def slack_headers(signature: str = SLACK_SIGNATURE) -> dict[str, str]:
    return {"x-slack-signature": signature, "x-slack-request-timestamp": SLACK_TIMESTAMP}


def test_slack_vector_passes_and_a_form_body_has_no_event_id() -> None:
    scheme = build_scheme("slack", [SLACK_SECRET])
    now = datetime.fromtimestamp(int(SLACK_TIMESTAMP), UTC) + timedelta(seconds=30)
    scheme.verify(slack_headers(), SLACK_BODY, now=now)
    assert scheme.event_id(slack_headers(), SLACK_BODY) is None
    signed = scheme.sign(SLACK_BODY, timestamp=datetime.fromtimestamp(int(SLACK_TIMESTAMP), UTC))
    assert signed == slack_headers()


@pytest.mark.parametrize(
    "signature",
    [SLACK_SIGNATURE[:-1], SLACK_SIGNATURE.replace("v0=", "v1="), "v0=", SLACK_SIGNATURE[3:]],
)
def test_slack_must_fail(signature: str) -> None:
    now = datetime.fromtimestamp(int(SLACK_TIMESTAMP), UTC)
    with pytest.raises(SignatureInvalid):
        build_scheme("slack", [SLACK_SECRET]).verify(slack_headers(signature), SLACK_BODY, now=now)


def test_standard_webhooks_non_ascii_id_as_the_receiver_decodes_it() -> None:
    # A sender signs the id's UTF-8 bytes; the receiver decodes header bytes as Latin-1 (as ASGI
    # servers deliver them), and verification must recover the bytes that were signed.
    msg_id = "msg_\u00e9\u4e2d"
    key = base64.b64decode(SW_SECRET.removeprefix("whsec_"))
    content = f"{msg_id}.{SW_TIMESTAMP}.".encode() + SW_BODY
    signature = "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()
    as_received = {
        "webhook-id": msg_id.encode().decode("latin-1"),
        "webhook-timestamp": SW_TIMESTAMP,
        "webhook-signature": signature,
    }
    build_scheme("standard-webhooks", [SW_SECRET]).verify(as_received, SW_BODY, now=SW_NOW)
