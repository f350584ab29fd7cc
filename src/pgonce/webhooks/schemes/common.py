"""The pieces every scheme shares: strict parsing of headers, tolerance, comparison, secrets.

Everything here turns bad input into a :class:`~pgonce.errors.WebhookError` subclass and bad
configuration into :class:`~pgonce.errors.ConfigError`; nothing lets ``ValueError``,
``UnicodeError``, ``binascii.Error`` or ``TypeError`` escape. Messages name headers and secrets by
position, never by value: a secret or an expected signature never appears in one.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

from pgonce.core.inbox import integer_text
from pgonce.core.outcomes import MAX_KEY_BYTES
from pgonce.errors import (
    BadPayload,
    ConfigError,
    SignatureInvalid,
    TimestampOutOfTolerance,
    UsageError,
)
from pgonce.webhooks.schemes.base import Headers

#: How far a signed timestamp may be from ``now``, in either direction. Five minutes is what
#: Standard Webhooks, Stripe and Slack use: room for clock skew and a delivery queued at the
#: provider, yet too short for a captured delivery to be replayed later.
DEFAULT_TOLERANCE = timedelta(minutes=5)

#: At most this many entries of a signature list are looked at. A provider sends one per active
#: secret (two during a rotation); the cap keeps a header stuffed with thousands of entries from
#: costing thousands of HMAC comparisons or Ed25519 verifications.
MAX_SIGNATURES = 32

#: The longest event id, in UTF-8 bytes: the key store's limit, since the inbox claims on it.
MAX_EVENT_ID_BYTES = MAX_KEY_BYTES

#: The digest algorithms a scheme may name, mapped to hashlib's names.
ALGORITHMS = {"sha1": "sha1", "sha256": "sha256", "sha512": "sha512"}

# Unix seconds as ASCII digits only: int() would also accept " 12", "1_2" and Arabic-Indic digits.
_TIMESTAMP = re.compile(r"[0-9]{1,15}", re.ASCII)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def header(headers: Headers, name: str) -> str:
    """The value of a required header, or :class:`SignatureInvalid` when it is missing or empty."""
    value = headers.get(name)
    if not value:
        raise SignatureInvalid(f"the {name} header is missing")
    return value


def signed_timestamp(headers: Headers, name: str) -> tuple[str, int]:
    """The timestamp header as sent (it is part of the signed content) and as Unix seconds."""
    text = header(headers, name).strip()
    return text, parse_timestamp(text, name)


def parse_timestamp(text: str, name: str) -> int:
    if not _TIMESTAMP.fullmatch(text):
        raise SignatureInvalid(f"the {name} is not a Unix timestamp in whole seconds")
    return int(text)


def check_tolerance(timestamp: int, now: datetime, tolerance: timedelta) -> None:
    """Refuse a timestamp further than ``tolerance`` from ``now``, in the past **or** the future.

    A timestamp in the future is refused too: a verifier that only refuses old ones (Stripe's
    library does) lets a sender with a fast clock, or an attacker holding a signature made for
    later, extend the replay window at will.
    """
    seconds = aware(now).timestamp()
    limit = tolerance.total_seconds()
    if timestamp < seconds - limit:
        raise TimestampOutOfTolerance(
            f"the delivery was signed more than {limit:.0f} seconds ago (tolerance)"
        )
    if timestamp > seconds + limit:
        raise TimestampOutOfTolerance(
            f"the delivery is signed more than {limit:.0f} seconds in the future (tolerance)"
        )


def checked_tolerance(scheme: str, value: timedelta | float | None) -> timedelta:
    """The tolerance of a scheme: a timedelta or seconds, positive; ``None`` is the default.

    Every scheme's constructor checks it, not only :func:`~pgonce.webhooks.schemes.build_scheme`:
    a scheme built from its class with seconds failed each verification with an
    ``AttributeError``, and one with a tolerance of 0 or less refused every authentic delivery.
    """
    if value is None:
        return DEFAULT_TOLERANCE
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigError(f"the tolerance of the {scheme} scheme must be seconds or a timedelta")
    try:
        tolerance = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except (OverflowError, ValueError):
        raise ConfigError(f"the tolerance of the {scheme} scheme is out of range") from None
    if tolerance <= timedelta(0):
        raise ConfigError(f"the tolerance of the {scheme} scheme must be positive")
    return tolerance


def aware(moment: datetime) -> datetime:
    """``moment`` itself; a naive datetime is refused, since its meaning depends on the machine."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise UsageError("pass a timezone-aware datetime (for example datetime.now(UTC))")
    return moment


def unix_seconds(moment: datetime | None) -> int:
    """Whole Unix seconds of ``moment`` (the current time when ``None``), for signing."""
    return int((datetime.now(UTC) if moment is None else aware(moment)).timestamp())


def decode_hex(text: str) -> bytes | None:
    """The bytes of a hex signature (either case), or ``None`` when it is not strict hex."""
    # isalnum() shuts out the whitespace bytes.fromhex() would skip; fromhex refuses the rest.
    if not (text.isascii() and text.isalnum()):
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def decode_base64(text: str) -> bytes | None:
    """The bytes of a base64 signature, or ``None`` unless it is canonical, padded base64.

    Canonical means it re-encodes to the same text, so a signature has exactly one spelling: a
    dropped ``=`` or altered trailing bits are malformed, not "the same signature".
    """
    if len(text) % 4 or not text.isascii():
        return None
    encoded = text.encode("ascii")
    try:
        raw = binascii.a2b_base64(encoded, strict_mode=True)
    except binascii.Error:
        return None
    return raw if binascii.b2a_base64(raw, newline=False) == encoded else None


class HmacKey:
    """A secret with its HMAC state keyed once, at configuration time.

    Each signature then starts from a copy of that state instead of hashing the key's pads again,
    and takes its content in parts, so that a prefix never forces a copy of the body.
    """

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes, algorithm: str) -> None:
        self._keyed = hmac.new(key, digestmod=algorithm)

    def digest(self, *parts: bytes) -> bytes:
        mac = self._keyed.copy()
        for part in parts:
            mac.update(part)
        return mac.digest()


def matches_any(expected: Iterable[bytes], given: Sequence[bytes]) -> bool:
    """Whether any given signature equals any expected one, each compared in constant time."""
    return any(hmac.compare_digest(e, g) for e in expected for g in given)


def encode_header(value: str, name: str) -> bytes:
    """A header value that is part of the signed content, as the bytes that were sent.

    ASGI servers hand header values over as bytes and the receiver decodes them as Latin-1, which
    maps every byte to one character; encoding back as Latin-1 recovers exactly the bytes the
    sender signed, whatever their encoding. A value with characters beyond Latin-1 cannot have
    come that way (it was built in Python): it is taken as UTF-8.
    """
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise SignatureInvalid(f"the {name} header is not valid text") from None


def checked_event_id(value: str, where: str) -> str:
    """``value`` if the inbox can claim on it: 1 to 512 UTF-8 bytes, no control characters."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadPayload(f"the event id in {where} is not valid text") from None
    if not 0 < size <= MAX_EVENT_ID_BYTES:
        raise BadPayload(f"the event id in {where} must be 1 to {MAX_EVENT_ID_BYTES} bytes long")
    if _CONTROL.search(value):
        raise BadPayload(f"the event id in {where} contains control characters")
    return value


def header_event_id(headers: Headers, name: str) -> str | None:
    """The event id a header carries, ``None`` when the header is absent."""
    value = headers.get(name)
    return None if value is None else checked_event_id(value.strip(), f"the {name} header")


def json_object(body: bytes) -> dict[str, object]:
    """The body as a JSON object; :class:`BadPayload` when it is not UTF-8 or not an object.

    The body is decoded as strict UTF-8 first: ``json.loads`` given bytes would also guess UTF-16
    and UTF-32, and JSON on the wire is UTF-8 (RFC 8259).
    """
    try:
        document = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadPayload("the body is not UTF-8") from None
    except (ValueError, RecursionError):
        # ValueError covers JSONDecodeError and integers too long to convert; RecursionError a
        # body nested deeper than the parser's stack.
        raise BadPayload("the body is not valid JSON") from None
    if not isinstance(document, dict):
        raise BadPayload("the body is not a JSON object")
    return document


def json_event_id(
    document: Mapping[str, object], path: str, *, integers: bool = False
) -> str | None:
    """The string at a dotted ``path`` of a JSON object, ``None`` when it is absent (or null).

    With ``integers`` (a configured provider's field, which may be a JSON number), an integer
    (not a float, not a bool) is taken as its decimal text, as an integer ordering key is
    (:func:`~pgonce.core.inbox.integer_text`). A provider whose ids are always strings (Stripe's
    ``evt_...``, Slack's ``Ev...``) keeps refusing anything else.
    """
    value: object = document
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if value is None:
        return None
    text = value if isinstance(value, str) else integer_text(value) if integers else None
    if text is None:
        kind = "a string or an integer" if integers else "a string"
        raise BadPayload(f"the event id at {path!r} in the body is not {kind}")
    return checked_event_id(text, f"the body's {path!r}")


def text_secrets(scheme: str, secrets: Sequence[str]) -> tuple[bytes, ...]:
    """Secrets used as their UTF-8 bytes (Stripe, GitHub, Shopify, Slack, generic HMAC)."""
    keys = []
    for number, secret in enumerate(checked_secrets(scheme, secrets), 1):
        try:
            keys.append(secret.encode("utf-8"))
        except UnicodeEncodeError:
            raise ConfigError(
                f"secret #{number} of the {scheme} scheme is not valid text"
            ) from None
    return tuple(keys)


def decode_secret_base64(text: str, what: str) -> bytes:
    """A base64 secret; padding may be left off (the reference libraries accept that too)."""
    padded = text + "=" * (-len(text) % 4)
    if not _BASE64.fullmatch(padded):
        raise ConfigError(f"{what} is not valid base64")
    try:
        raw = base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{what} is not valid base64") from None
    if not raw:
        raise ConfigError(f"{what} is empty")
    return raw


def encode_base64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def checked_secrets(scheme: str, secrets: Sequence[str]) -> tuple[str, ...]:
    """The secrets, refused unless there is at least one and each is a clean non-empty string.

    Leading or trailing whitespace is refused rather than stripped: it is almost always a
    copy-paste accident, and silently verifying with another key than the one configured would
    hide it.
    """
    if isinstance(secrets, bytes | bytearray | memoryview):
        # A Sequence too, of ints: it was refused as "secret #1 must be a non-empty string".
        raise ConfigError(
            f"the secrets of the {scheme} scheme must be strings, not bytes: give the secret "
            "as the text the provider shows (bytes.decode())"
        )
    if isinstance(secrets, str) or not isinstance(secrets, Sequence):
        raise ConfigError(f"the secrets of the {scheme} scheme must be a list of strings")
    if not secrets:
        raise ConfigError(f"the {scheme} scheme needs at least one secret")
    for number, secret in enumerate(secrets, 1):
        if isinstance(secret, bytes | bytearray | memoryview):
            raise ConfigError(
                f"secret #{number} of the {scheme} scheme must be a string, not bytes: give it "
                "as the text the provider shows (bytes.decode())"
            )
        if not isinstance(secret, str) or not secret:
            raise ConfigError(f"secret #{number} of the {scheme} scheme must be a non-empty string")
        if secret != secret.strip():
            raise ConfigError(
                f"secret #{number} of the {scheme} scheme has leading or trailing whitespace"
            )
    return tuple(secrets)
