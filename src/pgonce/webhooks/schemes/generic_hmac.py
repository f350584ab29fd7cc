"""Generic HMAC: one signature header, configured algorithm, encoding and prefix.

For providers that sign ``HMAC(secret, [signed_prefix] + raw body)`` and send the digest in one
header. GitHub, Shopify and Slack are presets of this class (their own modules), so the three and
every configured provider share one verification path.

Options (all strings; ``header`` is required):

=================  =============  ======================================================
option             default        meaning
=================  =============  ======================================================
header             --             the signature header, e.g. ``x-signature``
algorithm          ``sha256``     ``sha1``, ``sha256`` or ``sha512``
encoding           ``hex``        ``hex`` (either case) or ``base64`` (canonical, padded)
prefix             ``""``         text before the digest in the header, e.g. ``sha256=``
secret_encoding    ``utf-8``      how the secret becomes the key: ``utf-8``, ``base64``, ``hex``
timestamp_header   none           a header with Unix seconds; enables the tolerance check
signed_prefix      see right      text signed before the body; ``{timestamp}`` is replaced by
                                  the timestamp header's value. With a timestamp header it
                                  defaults to ``{timestamp}.`` and must contain
                                  ``{timestamp}``; without one it defaults to ``""``.
id_header          none           a header carrying the event id
id_field           none           a dotted path to the event id in a JSON-object body: a
                                  string, or an integer taken as its decimal text
=================  =============  ======================================================

Without a timestamp header nothing bounds a replay in time; the inbox's dedupe by event id is then
the only replay protection, and only if the id is signed (``id_field``) -- an id header is not.
With both, the body's id is the event id, and the header's only where the body has none.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from pgonce.errors import ConfigError, SignatureInvalid
from pgonce.webhooks.schemes.base import Headers
from pgonce.webhooks.schemes.common import (
    ALGORITHMS,
    DEFAULT_TOLERANCE,
    HmacKey,
    check_tolerance,
    checked_secrets,
    checked_tolerance,
    decode_base64,
    decode_hex,
    decode_secret_base64,
    encode_base64,
    header,
    header_event_id,
    json_event_id,
    json_object,
    matches_any,
    signed_timestamp,
    text_secrets,
    unix_seconds,
)

NAME = "generic-hmac"

_PLACEHOLDER = "{timestamp}"
_ENCODINGS = ("hex", "base64")
_SECRET_ENCODINGS = ("utf-8", "base64", "hex")
OPTIONS = (
    "header",
    "algorithm",
    "encoding",
    "prefix",
    "secret_encoding",
    "timestamp_header",
    "signed_prefix",
    "id_header",
    "id_field",
)


class GenericHmac:
    """Verifier and signer for a single-header HMAC signature."""

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        header: str,
        algorithm: str = "sha256",
        encoding: str = "hex",
        prefix: str = "",
        secret_encoding: str = "utf-8",  # noqa: S107 (an encoding's name, not a secret)
        timestamp_header: str | None = None,
        signed_prefix: str | None = None,
        id_header: str | None = None,
        id_field: str | None = None,
        tolerance: timedelta | float = DEFAULT_TOLERANCE,
        name: str = NAME,
    ) -> None:
        self.name = name
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"{name}: algorithm must be one of {', '.join(ALGORITHMS)}")
        if encoding not in _ENCODINGS:
            raise ConfigError(f"{name}: encoding must be one of {', '.join(_ENCODINGS)}")
        if signed_prefix is None:
            signed_prefix = _PLACEHOLDER + "." if timestamp_header else ""
        if timestamp_header and _PLACEHOLDER not in signed_prefix:
            raise ConfigError(
                f"{name}: signed_prefix must contain {_PLACEHOLDER} when a timestamp header is "
                "set, or the timestamp would not be signed"
            )
        if not timestamp_header and _PLACEHOLDER in signed_prefix:
            raise ConfigError(f"{name}: signed_prefix uses {_PLACEHOLDER} but no timestamp_header")
        self._header = _header_name(name, "header", header) or ""
        self._encoding = encoding
        self._prefix = prefix
        self._timestamp_header = _header_name(name, "timestamp_header", timestamp_header)
        self._signed_prefix = signed_prefix
        self._id_header = _header_name(name, "id_header", id_header)
        self._id_field = id_field or None
        self._keys = tuple(
            HmacKey(k, ALGORITHMS[algorithm]) for k in _secrets(name, secrets, secret_encoding)
        )
        self.tolerance = checked_tolerance(name, tolerance)
        self.header_names = tuple(
            h for h in (self._header, self._timestamp_header, self._id_header) if h
        )

    def signature(self, key: HmacKey, timestamp: str | None, body: bytes) -> bytes:
        """The one definition of the digest, used by :meth:`sign` and :meth:`verify`."""
        lead = self._signed_prefix
        if timestamp is not None:
            lead = lead.replace(_PLACEHOLDER, timestamp)
        return key.digest(lead.encode("utf-8"), body)

    def verify(self, headers: Headers, body: bytes, *, now: datetime) -> None:
        value = header(headers, self._header).strip()
        if not value.startswith(self._prefix):
            raise SignatureInvalid(f"the {self._header} header lacks its {self._prefix!r} prefix")
        encoded = value[len(self._prefix) :]
        given = decode_hex(encoded) if self._encoding == "hex" else decode_base64(encoded)
        if given is None:
            raise SignatureInvalid(f"the {self._header} header is not {self._encoding}")
        timestamp_text: str | None = None
        timestamp = 0
        if self._timestamp_header:
            timestamp_text, timestamp = signed_timestamp(headers, self._timestamp_header)
        expected = (self.signature(key, timestamp_text, body) for key in self._keys)
        if not matches_any(expected, [given]):
            raise SignatureInvalid(f"the signature in the {self._header} header does not match")
        if timestamp_text is not None:
            check_tolerance(timestamp, now, self.tolerance)

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        # The body's id first: it is signed, and a header is not. Were the header to win, a
        # captured delivery sent again with another id header would pass for a new event.
        if self._id_field:
            # A JSON integer is its decimal text (Shopify-like senders number their events).
            found = json_event_id(json_object(body), self._id_field, integers=True)
            if found is not None:
                return found
        if self._id_header:
            return header_event_id(headers, self._id_header)
        return None

    def sign(
        self, body: bytes, *, event_id: str | None = None, timestamp: datetime | None = None
    ) -> dict[str, str]:
        """Headers for ``body``; ``event_id`` goes into the id header when one is configured."""
        headers: dict[str, str] = {}
        timestamp_text: str | None = None
        if self._timestamp_header:
            timestamp_text = str(unix_seconds(timestamp))
            headers[self._timestamp_header] = timestamp_text
        digest = self.signature(self._keys[0], timestamp_text, body)
        encoded = digest.hex() if self._encoding == "hex" else encode_base64(digest)
        headers[self._header] = self._prefix + encoded
        if self._id_header and event_id is not None:
            headers[self._id_header] = event_id
        return headers


def _header_name(scheme: str, option: str, value: str | None) -> str | None:
    """A header option in lower case (how the inbox passes names); ``None`` stays ``None``."""
    if value is None:
        return None
    name = value.strip().lower()
    if not name or not name.isascii() or any(c in name for c in " \t:"):
        raise ConfigError(f"{scheme}: {option} must be an HTTP header name")
    return name


def _secrets(scheme: str, secrets: Sequence[str], encoding: str) -> tuple[bytes, ...]:
    if encoding == "utf-8":
        return text_secrets(scheme, secrets)
    if encoding == "base64":
        return tuple(
            decode_secret_base64(s, f"secret #{n} of the {scheme} scheme")
            for n, s in enumerate(checked_secrets(scheme, secrets), 1)
        )
    if encoding == "hex":
        keys = []
        for number, secret in enumerate(checked_secrets(scheme, secrets), 1):
            try:
                keys.append(binascii.unhexlify(secret))
            except (binascii.Error, ValueError):
                raise ConfigError(f"secret #{number} of the {scheme} scheme is not hex") from None
        return tuple(keys)
    raise ConfigError(f"{scheme}: secret_encoding must be one of {', '.join(_SECRET_ENCODINGS)}")


def build(
    secrets: Sequence[str], tolerance: timedelta, options: Mapping[str, object]
) -> GenericHmac:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option(s) for the {NAME} scheme: {', '.join(unknown)}; "
            f"it takes {', '.join(OPTIONS)}"
        )
    if "header" not in options:
        raise ConfigError(f"the {NAME} scheme needs the 'header' option (the signature header)")
    values: dict[str, str] = {}
    for option, value in options.items():
        if not isinstance(value, str):
            raise ConfigError(f"{NAME}: option {option!r} must be a string")
        values[option] = value
    return GenericHmac(
        secrets,
        tolerance=tolerance,
        header=values["header"],
        algorithm=values.get("algorithm", "sha256"),
        encoding=values.get("encoding", "hex"),
        prefix=values.get("prefix", ""),
        secret_encoding=values.get("secret_encoding", "utf-8"),
        timestamp_header=values.get("timestamp_header"),
        signed_prefix=values.get("signed_prefix"),
        id_header=values.get("id_header"),
        id_field=values.get("id_field"),
    )
