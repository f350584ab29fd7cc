"""Hypothesis fuzzing: whatever arrives, a scheme answers with a WebhookError or passes.

Headers are drawn both as arbitrary text and as near-misses of each scheme's real syntax (the
inputs that reach the deep parsing paths); bodies are arbitrary bytes. ``verify`` and
``event_id`` may only raise :class:`~pgonce.errors.WebhookError` subclasses -- anything else
would be a 500 in the inbox. A second group proves that sign/verify round-trip for any body and
that any change to a signed body is caught.
"""

from __future__ import annotations

import base64
import contextlib
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgonce.errors import SignatureInvalid, WebhookError
from pgonce.webhooks.schemes import SCHEMES, SigningScheme, build_scheme

SECRETS = {
    "standard-webhooks": ["whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"],
    "stripe": ["whsec_test_secret"],
    "github": ["It's a Secret to Everybody"],
    "shopify": ["shpss_secret"],
    "slack": ["8f742231b10e8888abcd99yyyzzz85a5"],
    "generic-hmac": ["generic"],
}
GENERIC_OPTIONS: dict[str, object] = {
    "header": "x-sig",
    "encoding": "base64",
    "prefix": "sha512=",
    "algorithm": "sha512",
    "timestamp_header": "x-ts",
    "id_field": "id",
}
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
FUZZ = settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(name: str) -> SigningScheme:
    options = GENERIC_OPTIONS if name == "generic-hmac" else None
    return build_scheme(name, SECRETS[name], options=options)


# Fragments of real syntax, so that examples get past the first check.
digits = st.integers(min_value=-10, max_value=10**16).map(str)
near_now = st.integers(min_value=-400, max_value=400).map(lambda d: str(int(NOW.timestamp()) + d))
hexish = st.one_of(
    st.binary(max_size=70).map(bytes.hex),
    st.text(alphabet="0123456789abcdefABCDEFxz ", max_size=70),
)
b64ish = st.one_of(
    st.binary(max_size=70).map(lambda b: base64.b64encode(b).decode()),
    st.text(alphabet="ABCabc012+/=-_ ,", max_size=90),
)
sw_entry = st.tuples(
    st.sampled_from(["v1", "v1a", "v2", "", "V1"]), st.sampled_from([",", "", ";"]), b64ish
).map("".join)
stripe_item = st.one_of(
    st.tuples(st.just("t="), st.one_of(digits, near_now, st.text(max_size=5))).map("".join),
    st.tuples(st.sampled_from(["v1=", "v0=", "v1", "=", ""]), hexish).map("".join),
    st.text(max_size=10),
)
anything = st.text(max_size=120)

VALUES = {
    "webhook-signature": st.lists(sw_entry, max_size=40).map(" ".join) | anything,
    "webhook-timestamp": digits | near_now | anything,
    "webhook-id": st.text(min_size=0, max_size=40) | st.just("msg_1"),
    "stripe-signature": st.lists(stripe_item, max_size=8).map(",".join) | anything,
    "x-hub-signature-256": st.tuples(st.sampled_from(["sha256=", "sha1=", ""]), hexish).map("".join)
    | anything,
    "x-github-delivery": anything,
    "x-shopify-hmac-sha256": b64ish | anything,
    "x-shopify-webhook-id": anything,
    "x-slack-signature": st.tuples(st.sampled_from(["v0=", "v1=", ""]), hexish).map("".join)
    | anything,
    "x-slack-request-timestamp": digits | near_now | anything,
    "x-sig": st.tuples(st.sampled_from(["sha512=", ""]), b64ish).map("".join) | anything,
    "x-ts": digits | near_now | anything,
}


SCHEME_OBJECTS = {name: build(name) for name in sorted(SCHEMES)}
ALL_HEADERS = sorted({h for scheme in SCHEME_OBJECTS.values() for h in scheme.header_names})


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    """Headers of every scheme at once (each scheme reads its own), and a body."""
    headers = {}
    for header in ALL_HEADERS:
        if draw(st.integers(0, 9)):  # mostly present, sometimes missing
            headers[header] = draw(VALUES.get(header, anything))
    if draw(st.booleans()):
        headers[draw(st.text(max_size=10))] = draw(anything)
    body = draw(
        st.one_of(
            st.binary(max_size=300),
            st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
            st.dictionaries(
                st.sampled_from(["id", "event_id", "x"]),
                st.one_of(st.text(max_size=20), st.integers(), st.none()),
            ).map(lambda d: repr(d).replace("'", '"').encode()),
        )
    )
    return headers, body


@FUZZ
@given(
    delivery=deliveries(),
    now=st.datetimes(
        min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
    ),
)
def test_verify_and_event_id_raise_only_webhook_errors(
    delivery: tuple[dict[str, str], bytes], now: datetime
) -> None:
    headers, body = delivery
    for scheme in SCHEME_OBJECTS.values():
        with contextlib.suppress(WebhookError):
            scheme.verify(headers, body, now=now)
        try:
            found = scheme.event_id(headers, body)
        except WebhookError:
            continue
        assert found is None or 0 < len(found.encode()) <= 512


event_ids = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, exclude_characters="\x7f"),
    min_size=1,
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_sign_then_verify_round_trips_and_any_body_change_is_caught(name: str) -> None:
    scheme = build(name)

    @settings(max_examples=200, deadline=None)
    @given(
        body=st.binary(max_size=2000),
        event_id=event_ids,
        skew=st.integers(min_value=-300, max_value=300),
        flip=st.integers(min_value=0, max_value=10**6),
    )
    def check(body: bytes, event_id: str, skew: int, flip: int) -> None:
        headers = scheme.sign(body, event_id=event_id, timestamp=NOW + timedelta(seconds=skew))
        scheme.verify(headers, body, now=NOW)
        if body:
            changed = bytearray(body)
            changed[flip % len(body)] ^= 1 << (flip % 8)
            altered = bytes(changed)
        else:
            altered = b"\x00"
        with pytest.raises(SignatureInvalid):
            scheme.verify(headers, altered, now=NOW)

    check()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_any_change_to_a_signature_header_is_refused(name: str) -> None:
    scheme = build(name)
    body = b'{"id":"evt_1","event_id":"Ev1"}'
    signed = scheme.sign(body, event_id="e1", timestamp=NOW)
    signature_header = (
        scheme.header_names[-1] if name == "standard-webhooks" else scheme.header_names[0]
    )

    @settings(max_examples=300, deadline=None)
    @given(position=st.integers(min_value=0), replacement=st.characters())
    def check(position: int, replacement: str) -> None:
        value = signed[signature_header]
        i = position % len(value)
        if value[i] == replacement:
            return
        changed = signed | {signature_header: value[:i] + replacement + value[i + 1 :]}
        try:
            scheme.verify(changed, body, now=NOW)
        except WebhookError:
            return
        # The only change that may still verify: a hex digit's case (the same signature).
        assert value[i].lower() == replacement.lower()

    check()
