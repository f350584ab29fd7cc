"""Stripe: ``Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>...]``.

The signature is the hex HMAC-SHA256 of ``{t}.{raw body}``, keyed with the **whole** endpoint
secret (``whsec_...``) as UTF-8 -- unlike Standard Webhooks, Stripe does not base64-decode it.
Several ``v1`` entries may be present while Stripe rolls a secret; one match is enough. Other
schemes (``v0``, the test-mode legacy) are ignored. The timestamp is held to the tolerance in both
directions (Stripe's own library checks only that it is not too old). The event id is the body's
``id`` (``evt_...``), which the signature covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from pgonce.errors import SignatureInvalid
from pgonce.webhooks.schemes.base import Headers
from pgonce.webhooks.schemes.common import (
    DEFAULT_TOLERANCE,
    MAX_SIGNATURES,
    HmacKey,
    check_tolerance,
    checked_tolerance,
    decode_hex,
    header,
    json_event_id,
    json_object,
    matches_any,
    parse_timestamp,
    text_secrets,
    unix_seconds,
)

NAME = "stripe"
SIGNATURE_HEADER = "stripe-signature"


def signature(key: HmacKey, timestamp: str, body: bytes) -> bytes:
    """The one definition of Stripe's signature, used by :meth:`~Stripe.sign` and verify."""
    return key.digest(timestamp.encode("ascii"), b".", body)


class Stripe:
    """Verifier and signer for Stripe's ``Stripe-Signature`` header."""

    name: str = NAME
    header_names: tuple[str, ...] = (SIGNATURE_HEADER,)

    def __init__(
        self, secrets: Sequence[str], *, tolerance: timedelta | float = DEFAULT_TOLERANCE
    ) -> None:
        self._keys = tuple(HmacKey(k, "sha256") for k in text_secrets(NAME, secrets))
        self.tolerance = checked_tolerance(NAME, tolerance)

    def verify(self, headers: Headers, body: bytes, *, now: datetime) -> None:
        timestamps: list[str] = []
        signatures: list[bytes] = []
        for item in header(headers, SIGNATURE_HEADER).split(",")[: 2 * MAX_SIGNATURES]:
            name, equals, value = item.strip().partition("=")
            if not equals:
                continue
            if name == "t":
                timestamps.append(value)
            elif name == "v1" and (decoded := decode_hex(value)) is not None:
                signatures.append(decoded)
        if len(timestamps) != 1:
            raise SignatureInvalid(f"the {SIGNATURE_HEADER} header needs exactly one t= entry")
        timestamp = parse_timestamp(timestamps[0], f"{SIGNATURE_HEADER} t= entry")
        if not signatures:
            raise SignatureInvalid(f"the {SIGNATURE_HEADER} header has no v1 signature")
        expected = (signature(key, timestamps[0], body) for key in self._keys)
        if not matches_any(expected, signatures):
            raise SignatureInvalid(f"no v1 signature in the {SIGNATURE_HEADER} header matches")
        check_tolerance(timestamp, now, self.tolerance)

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        return json_event_id(json_object(body), "id")

    def sign(
        self, body: bytes, *, event_id: str | None = None, timestamp: datetime | None = None
    ) -> dict[str, str]:
        """Headers for ``body``; the event id is the body's ``id``, so ``event_id`` is unused."""
        t = str(unix_seconds(timestamp))
        return {SIGNATURE_HEADER: f"t={t},v1={signature(self._keys[0], t, body).hex()}"}
