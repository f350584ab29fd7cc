"""The rules every scheme keeps: rotation, tolerance both ways, strict headers, ids, config."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pgonce.errors import (
    BadPayload,
    ConfigError,
    SignatureInvalid,
    TimestampOutOfTolerance,
    UsageError,
    WebhookError,
)
from pgonce.webhooks.schemes import (
    DEFAULT_TOLERANCE,
    SCHEMES,
    build_scheme,
    delivery_event_id,
    fallback_event_id,
)
from pgonce.webhooks.schemes.slack import Slack

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SW = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
BODY = b'{"id":"evt_1","event_id":"Ev1","data":{"n":1}}'
GENERIC: dict[str, object] = {"header": "x-signature"}


def options_for(name: str) -> dict[str, object] | None:
    return GENERIC if name == "generic-hmac" else None


def secret_for(name: str, n: int = 0) -> str:
    if name == "standard-webhooks":
        return "whsec_" + base64.b64encode(bytes([n + 1]) * 24).decode()
    return f"secret-{name}-{n}"


TIMED = ["standard-webhooks", "stripe", "slack"]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_round_trip_and_rotation(name: str) -> None:
    old, new = secret_for(name, 0), secret_for(name, 1)
    verifier = build_scheme(name, [new, old], options=options_for(name))
    for secret in (old, new):
        signer = build_scheme(name, [secret], options=options_for(name))
        verifier.verify(signer.sign(BODY, event_id="e1", timestamp=NOW), BODY, now=NOW)
    retired = build_scheme(name, [secret_for(name, 2)], options=options_for(name))
    with pytest.raises(SignatureInvalid):
        verifier.verify(retired.sign(BODY, event_id="e1", timestamp=NOW), BODY, now=NOW)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_header_names_cover_what_sign_writes(name: str) -> None:
    built = build_scheme(name, [secret_for(name)], options=options_for(name))
    assert set(built.sign(BODY, event_id="e1", timestamp=NOW)) <= set(built.header_names)
    assert all(h == h.lower() for h in built.header_names)


@pytest.mark.parametrize("name", TIMED)
@pytest.mark.parametrize(
    ("offset", "passes"),
    [
        (timedelta(0), True),
        (DEFAULT_TOLERANCE, True),
        (-DEFAULT_TOLERANCE, True),
        (DEFAULT_TOLERANCE + timedelta(seconds=1), False),
        (-DEFAULT_TOLERANCE - timedelta(seconds=1), False),
        (timedelta(days=3650), False),
        (timedelta(days=-3650), False),
    ],
)
def test_tolerance_in_both_directions(name: str, offset: timedelta, passes: bool) -> None:
    built = build_scheme(name, [secret_for(name)])
    headers = built.sign(BODY, event_id="e1", timestamp=NOW + offset)
    if passes:
        built.verify(headers, BODY, now=NOW)
    else:
        with pytest.raises(TimestampOutOfTolerance):
            built.verify(headers, BODY, now=NOW)


@pytest.mark.parametrize("name", TIMED)
def test_tolerance_is_per_source(name: str) -> None:
    headers = build_scheme(name, [secret_for(name)]).sign(
        BODY, timestamp=NOW - timedelta(minutes=20)
    )
    build_scheme(name, [secret_for(name)], tolerance=timedelta(minutes=30)).verify(
        headers, BODY, now=NOW
    )
    with pytest.raises(TimestampOutOfTolerance):
        build_scheme(name, [secret_for(name)], tolerance=60).verify(headers, BODY, now=NOW)


def test_a_stale_forgery_is_a_bad_signature_not_a_stale_delivery() -> None:
    # The signature is checked first: "out of tolerance" means authentic but replayed or skewed.
    built = build_scheme("stripe", ["whsec_a"])
    forged = build_scheme("stripe", ["whsec_b"]).sign(BODY, timestamp=NOW - timedelta(days=1))
    with pytest.raises(SignatureInvalid):
        built.verify(forged, BODY, now=NOW)


def test_now_must_be_timezone_aware() -> None:
    built = build_scheme("stripe", ["whsec_a"])
    with pytest.raises(UsageError):
        built.verify(built.sign(BODY, timestamp=NOW), BODY, now=datetime(2026, 11, 29, 12))


MALFORMED: list[tuple[str, dict[str, str]]] = [
    ("standard-webhooks", {}),
    ("standard-webhooks", {"webhook-id": "m", "webhook-timestamp": "1", "webhook-signature": ""}),
    ("standard-webhooks", {"webhook-id": "m", "webhook-signature": "v1,AAAA"}),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "12a", "webhook-signature": "v1,AAAA"},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "1.5", "webhook-signature": "v1,AAAA"},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "1_000", "webhook-signature": "v1,A"},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "\u0661\u0662", "webhook-signature": "v1,A"},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "\ud800", "webhook-timestamp": "1", "webhook-signature": "v1,A"},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "1", "webhook-signature": "v1,\u00e9\u00e9=="},
    ),
    (
        "standard-webhooks",
        {"webhook-id": "m", "webhook-timestamp": "1", "webhook-signature": "v1a,!!!!"},
    ),
    ("stripe", {}),
    ("stripe", {"stripe-signature": "garbage"}),
    ("stripe", {"stripe-signature": "v1=00"}),
    ("stripe", {"stripe-signature": "t=,v1=00"}),
    ("stripe", {"stripe-signature": "t=1"}),
    ("stripe", {"stripe-signature": "t=1,t=2,v1=00"}),
    ("stripe", {"stripe-signature": "t=1,v1=zz"}),
    ("stripe", {"stripe-signature": "t=1,v1=0"}),
    ("stripe", {"stripe-signature": "t=1,v1=\u00e9\u00e9"}),
    ("stripe", {"stripe-signature": "t= 1,v1=00"}),
    ("github", {}),
    ("github", {"x-hub-signature-256": "sha256=zz"}),
    ("github", {"x-hub-signature-256": "sha256=ab cd"}),
    ("github", {"x-hub-signature-256": "md5=00"}),
    ("shopify", {"x-shopify-hmac-sha256": "not base64!"}),
    ("shopify", {"x-shopify-hmac-sha256": "\u00e9"}),
    ("slack", {"x-slack-signature": "v0=00"}),
    ("slack", {"x-slack-signature": "v0=00", "x-slack-request-timestamp": "-5"}),
    ("generic-hmac", {"x-signature": "\x00"}),
]


@pytest.mark.parametrize(("name", "headers"), MALFORMED)
def test_malformed_headers_are_signature_invalid(name: str, headers: dict[str, str]) -> None:
    built = build_scheme(name, [secret_for(name)], options=options_for(name))
    with pytest.raises(SignatureInvalid):
        built.verify(headers, BODY, now=NOW)


def test_shopify_signature_is_base64_of_the_body_hmac() -> None:
    expected = base64.b64encode(hmac.new(b"shpss_1", BODY, hashlib.sha256).digest()).decode()
    built = build_scheme("shopify", ["shpss_1"])
    headers = {"x-shopify-hmac-sha256": expected, "x-shopify-webhook-id": "b54557e4"}
    built.verify(headers, BODY, now=NOW)
    assert built.event_id(headers, BODY) == "b54557e4"
    with pytest.raises(SignatureInvalid):  # the hex spelling of the same digest is not Shopify's
        built.verify(
            {"x-shopify-hmac-sha256": hmac.new(b"shpss_1", BODY, hashlib.sha256).hexdigest()},
            BODY,
            now=NOW,
        )


# --- Standard Webhooks v1a (Ed25519): no published vector, so round trips and negatives.


def ed25519_pair() -> tuple[str, str, Ed25519PrivateKey]:
    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return (
        "whsk_" + base64.b64encode(seed).decode(),
        "whpk_" + base64.b64encode(public).decode(),
        private,
    )


def test_v1a_signed_with_whsk_verified_with_whpk() -> None:
    secret_key, public_key, private = ed25519_pair()
    headers = build_scheme("standard-webhooks", [secret_key]).sign(
        BODY, event_id="m1", timestamp=NOW
    )
    assert headers["webhook-signature"].startswith("v1a,")
    build_scheme("standard-webhooks", [public_key]).verify(headers, BODY, now=NOW)
    # An independent signature made by cryptography directly, over id.timestamp.body.
    raw = private.sign(b"m1.%d.%s" % (int(NOW.timestamp()), BODY))
    direct = headers | {"webhook-signature": "v1a," + base64.b64encode(raw).decode()}
    build_scheme("standard-webhooks", [public_key]).verify(direct, BODY, now=NOW)


def test_v1a_accepts_libsodium_64_byte_secret_keys() -> None:
    _, public_key, private = ed25519_pair()
    seed = private.private_bytes_raw()
    pub = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    secret = "whsk_" + base64.b64encode(seed + pub).decode()
    headers = build_scheme("standard-webhooks", [secret]).sign(BODY, event_id="m", timestamp=NOW)
    build_scheme("standard-webhooks", [public_key]).verify(headers, BODY, now=NOW)


def test_v1a_negatives() -> None:
    secret_key, public_key, _ = ed25519_pair()
    _, other_public, _ = ed25519_pair()
    headers = build_scheme("standard-webhooks", [secret_key]).sign(
        BODY, event_id="m", timestamp=NOW
    )
    verifier = build_scheme("standard-webhooks", [public_key])
    with pytest.raises(SignatureInvalid):
        build_scheme("standard-webhooks", [other_public]).verify(headers, BODY, now=NOW)
    with pytest.raises(SignatureInvalid):
        verifier.verify(headers, BODY + b"x", now=NOW)
    with pytest.raises(SignatureInvalid):
        verifier.verify(headers | {"webhook-id": "m2"}, BODY, now=NOW)
    # The same bytes labelled v1 are not an HMAC signature.
    relabelled = headers["webhook-signature"].replace("v1a,", "v1,")
    with pytest.raises(SignatureInvalid):
        verifier.verify(headers | {"webhook-signature": relabelled}, BODY, now=NOW)
    truncated = headers["webhook-signature"][:-8] + "AAAAAA=="
    with pytest.raises(SignatureInvalid):
        verifier.verify(headers | {"webhook-signature": truncated}, BODY, now=NOW)


def test_v1_and_v1a_keys_mix_in_one_source() -> None:
    secret_key, public_key, _ = ed25519_pair()
    verifier = build_scheme("standard-webhooks", [SW, public_key])
    for signer in ([SW], [secret_key]):
        headers = build_scheme("standard-webhooks", signer).sign(BODY, timestamp=NOW)
        verifier.verify(headers, BODY, now=NOW)


def test_public_keys_cannot_sign() -> None:
    _, public_key, _ = ed25519_pair()
    with pytest.raises(UsageError):
        build_scheme("standard-webhooks", [public_key]).sign(BODY)


def test_signature_list_is_capped() -> None:
    built = build_scheme("standard-webhooks", [SW])
    good = built.sign(BODY, event_id="m", timestamp=NOW)
    stuffed = " ".join(["v1,AAAA"] * 40 + [good["webhook-signature"]])
    with pytest.raises(SignatureInvalid):
        built.verify(good | {"webhook-signature": stuffed}, BODY, now=NOW)
    near = " ".join(["v1,AAAA"] * 31 + [good["webhook-signature"]])
    built.verify(good | {"webhook-signature": near}, BODY, now=NOW)


# --- generic HMAC options


@pytest.mark.parametrize("algorithm", ["sha1", "sha256", "sha512"])
@pytest.mark.parametrize("encoding", ["hex", "base64"])
def test_generic_hmac_algorithms_and_encodings(algorithm: str, encoding: str) -> None:
    options = {"header": "X-Sig", "algorithm": algorithm, "encoding": encoding, "prefix": "h="}
    built = build_scheme("generic-hmac", ["k"], options=options)
    digest = hmac.new(b"k", BODY, algorithm).digest()
    text = digest.hex() if encoding == "hex" else base64.b64encode(digest).decode()
    built.verify({"x-sig": "h=" + text}, BODY, now=NOW)
    assert built.sign(BODY) == {"x-sig": "h=" + text}


def test_generic_hmac_with_timestamp_and_ids() -> None:
    options = {
        "header": "x-sig",
        "timestamp_header": "x-ts",
        "signed_prefix": "{timestamp}:",
        "id_header": "x-id",
        "id_field": "meta.delivery",
        "secret_encoding": "base64",
    }
    built = build_scheme("generic-hmac", [base64.b64encode(b"\x00key").decode()], options=options)
    t = str(int(NOW.timestamp()))
    body = b'{"meta":{"delivery":"d-7"}}'
    sig = hmac.new(b"\x00key", t.encode() + b":" + body, hashlib.sha256).hexdigest()
    built.verify({"x-sig": sig, "x-ts": t}, body, now=NOW)
    assert built.event_id({"x-sig": sig, "x-ts": t}, body) == "d-7"
    # The signed body's id wins over the unsigned header: a captured delivery sent again with
    # another id header is still the same event.
    assert built.event_id({"x-id": "h-1"}, body) == "d-7"
    assert built.event_id({"x-id": "h-1"}, b'{"meta":{}}') == "h-1"
    with pytest.raises(TimestampOutOfTolerance):
        built.verify({"x-sig": sig, "x-ts": t}, body, now=NOW + timedelta(hours=1))
    assert built.header_names == ("x-sig", "x-ts", "x-id")


# --- event ids


def test_event_ids_come_from_the_right_place() -> None:
    stripe = build_scheme("stripe", ["whsec_a"])
    assert stripe.event_id({}, b'{"id":"evt_9"}') == "evt_9"
    assert stripe.event_id({}, b'{"object":"event"}') is None
    slack = build_scheme("slack", ["s"])
    assert slack.event_id({}, b' {"event_id":"Ev9"}') == "Ev9"
    assert slack.event_id({}, b'{"type":"url_verification","challenge":"c"}') is None
    assert isinstance(slack, Slack)
    assert slack.handshake(b'{"type":"url_verification","challenge":"c"}') == b'{"challenge": "c"}'
    assert slack.handshake(b'{"type":"event_callback","event_id":"Ev9"}') is None
    assert slack.handshake(b"command=/url_verification") is None
    with pytest.raises(BadPayload, match="no challenge"):
        slack.handshake(b'{"type":"url_verification","challenge":7}')
    github = build_scheme("github", ["s"])
    assert github.event_id({"x-github-delivery": "g-1"}, b"") == "g-1"
    assert github.event_id({}, b"") is None


@pytest.mark.parametrize(
    ("name", "headers", "body"),
    [
        ("stripe", {}, b"\xff\xfe"),
        ("stripe", {}, b"not json"),
        ("stripe", {}, b"[1,2]"),
        ("stripe", {}, b'{"id":42}'),
        ("stripe", {}, b'{"id":""}'),
        ("stripe", {}, json.dumps({"id": "x" * 513}).encode()),
        ("stripe", {}, b'{"id":"a\\nb"}'),
        ("stripe", {}, b"[" * 100_000),
        ("stripe", {}, b'{"id":' + b"9" * 5000 + b"}"),
        ("stripe", {}, "\ufeff{}".encode()),
        ("stripe", {}, '{"id":"e"}'.encode("utf-16")),
        ("slack", {}, b"{broken"),
        ("slack", {}, b"\xc3\x28=1"),
        ("github", {"x-github-delivery": ""}, b""),
        ("github", {"x-github-delivery": "a\x00b"}, b""),
        ("standard-webhooks", {"webhook-id": "x" * 600}, b""),
    ],
)
def test_unusable_event_ids_are_bad_payload(
    name: str, headers: dict[str, str], body: bytes
) -> None:
    with pytest.raises(BadPayload):
        build_scheme(name, [secret_for(name)]).event_id(headers, body)


def test_fallback_event_id_is_a_stable_hash_of_the_body() -> None:
    github = build_scheme("github", ["s"])
    first = delivery_event_id(github, {}, BODY)
    assert first == fallback_event_id(BODY) == delivery_event_id(github, {"x-other": "1"}, BODY)
    assert first.startswith("sha256:")
    assert len(first) == len("sha256:") + 64
    assert fallback_event_id(BODY + b" ") != first
    assert delivery_event_id(github, {"x-github-delivery": "g"}, BODY) == "g"


# --- configuration


@pytest.mark.parametrize(
    ("name", "secrets", "kwargs", "message"),
    [
        ("nope", ["s"], {}, "unknown webhook signature scheme"),
        ("stripe", [], {}, "at least one secret"),
        ("stripe", [""], {}, "non-empty"),
        ("stripe", ["whsec_x "], {}, "whitespace"),
        ("stripe", ["whsec_x"], {"options": {"header": "x"}}, "takes no options"),
        ("stripe", ["whsec_x"], {"tolerance": 0}, "positive"),
        ("stripe", ["whsec_x"], {"tolerance": -5}, "positive"),
        ("stripe", ["whsec_x"], {"tolerance": float("inf")}, "out of range"),
        ("stripe", ["whsec_x"], {"tolerance": "300"}, "seconds or a timedelta"),
        ("stripe", ["whsec_\ud800"], {}, "not valid text"),
        ("standard-webhooks", ["whsec_not base64!"], {}, "not valid base64"),
        ("standard-webhooks", ["whsec_"], {}, "empty"),
        ("standard-webhooks", ["whpk_AAAA"], {}, "32-byte"),
        ("standard-webhooks", ["whsk_AAAA"], {}, "32-byte Ed25519 seed"),
        ("generic-hmac", ["s"], {}, "needs the 'header' option"),
        ("generic-hmac", ["s"], {"options": {"header": "x", "hedaer": "y"}}, "unknown option"),
        ("generic-hmac", ["s"], {"options": {"header": "x", "algorithm": "md5"}}, "algorithm"),
        ("generic-hmac", ["s"], {"options": {"header": "x", "encoding": "b32"}}, "encoding"),
        ("generic-hmac", ["s"], {"options": {"header": "a b"}}, "header name"),
        (
            "generic-hmac",
            ["s"],
            {"options": {"header": "x", "timestamp_header": "t", "signed_prefix": "v0:"}},
            "{timestamp}",
        ),
        (
            "generic-hmac",
            ["s"],
            {"options": {"header": "x", "signed_prefix": "{timestamp}"}},
            "no timestamp_header",
        ),
        ("generic-hmac", ["zz"], {"options": {"header": "x", "secret_encoding": "hex"}}, "not hex"),
        (
            "generic-hmac",
            ["s"],
            {"options": {"header": "x", "secret_encoding": "rot13"}},
            "secret_encoding",
        ),
        ("generic-hmac", ["s"], {"options": {"header": 5}}, "must be a string"),
    ],
)
def test_bad_configuration_is_config_error(
    name: str, secrets: list[str], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", "\\{").replace("}", "\\}")) as info:
        build_scheme(name, secrets, **kwargs)  # type: ignore[arg-type]
    for secret in secrets:
        if len(secret) > 2 and secret != "whsec_":  # a bare prefix or a letter is no secret
            assert secret not in str(info.value)


def test_a_single_secret_string_is_one_secret() -> None:
    built = build_scheme("github", "It's a Secret to Everybody")
    built.verify(built.sign(b"x"), b"x", now=NOW)


def test_whsk_with_a_foreign_public_half_is_refused() -> None:
    secret_key, _, _ = ed25519_pair()
    _, other_public, _ = ed25519_pair()
    seed = base64.b64decode(secret_key[5:])
    mixed = "whsk_" + base64.b64encode(seed + base64.b64decode(other_public[5:])).decode()
    with pytest.raises(ConfigError, match="does not belong"):
        build_scheme("standard-webhooks", [mixed])


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_messages_reveal_no_secret_and_no_expected_signature(name: str) -> None:
    secret = secret_for(name)
    built = build_scheme(name, [secret], options=options_for(name))
    good = built.sign(BODY, event_id="e1", timestamp=NOW)
    forged = build_scheme(name, [secret_for(name, 5)], options=options_for(name)).sign(
        BODY, event_id="e1", timestamp=NOW
    )
    with pytest.raises(WebhookError) as info:
        built.verify(forged, BODY, now=NOW)
    text = str(info.value)
    assert secret not in text
    for value in good.values():
        assert value not in text or value in ("e1", str(int(NOW.timestamp())))
