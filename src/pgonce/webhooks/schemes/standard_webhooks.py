"""Standard Webhooks: ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` headers.

The signed content is ``{id}.{timestamp}.{raw body}``. ``webhook-signature`` is a space-separated
list of ``version,base64`` entries; one valid entry is enough (a sender signs with every active
secret while it rotates). Two versions are known:

- ``v1``: HMAC-SHA256 with the secret's key: the base64 after ``whsec_`` (the reference libraries'
  convention; a secret without the prefix is taken as base64 too);
- ``v1a``: Ed25519; verification takes a ``whpk_`` public key (base64 of its 32 raw bytes), and
  a ``whsk_`` secret key (base64 of the 32-byte seed, or of libsodium's 64-byte seed + public key)
  both signs and verifies.

Entries with another version, without a comma or with malformed base64 count as non-matching; a
header in which nothing matches is :class:`~pgonce.errors.SignatureInvalid`. The event id is the
``webhook-id`` header, which the signature covers.
"""

from __future__ import annotations

import secrets as random_ids
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from pgonce.core.frozen import refuse_changes
from pgonce.errors import ConfigError, SignatureInvalid, UsageError
from pgonce.extras import needs
from pgonce.webhooks.schemes.base import Headers
from pgonce.webhooks.schemes.common import (
    DEFAULT_TOLERANCE,
    MAX_SIGNATURES,
    HmacKey,
    check_tolerance,
    checked_event_id,
    checked_secrets,
    checked_tolerance,
    decode_base64,
    decode_secret_base64,
    encode_base64,
    encode_header,
    header,
    matches_any,
    signed_timestamp,
    unix_seconds,
)

if TYPE_CHECKING:
    # v1a's keys; the library is imported only when a v1a key is configured (extra `ed25519`).
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

NAME = "standard-webhooks"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"

_ED25519_SIGNATURE_BYTES = 64


@refuse_changes
@dataclass(frozen=True, slots=True)
class _Keys:
    """The configured secrets, sorted by what they can do."""

    hmac: tuple[HmacKey, ...]
    public: tuple[Ed25519PublicKey, ...]
    #: The first secret that can sign: ("v1", key bytes) or ("v1a", private key); None if none.
    signer: tuple[str, HmacKey | Ed25519PrivateKey] | None


def signed_lead(msg_id: str, timestamp: str) -> bytes:
    """What both versions sign before the body: ``{id}.{timestamp}.``; the one definition that
    :meth:`~StandardWebhooks.sign` and :meth:`~StandardWebhooks.verify` use."""
    return b"%s.%s." % (encode_header(msg_id, ID_HEADER), timestamp.encode("ascii"))


class StandardWebhooks:
    """Verifier and signer for Standard Webhooks v1 (HMAC-SHA256) and v1a (Ed25519)."""

    name: str = NAME
    header_names: tuple[str, ...] = (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)

    def __init__(
        self, secrets: Sequence[str], *, tolerance: timedelta | float = DEFAULT_TOLERANCE
    ) -> None:
        self._keys = _parse_keys(secrets)
        self.tolerance = checked_tolerance(NAME, tolerance)

    def verify(self, headers: Headers, body: bytes, *, now: datetime) -> None:
        msg_id = header(headers, ID_HEADER)
        timestamp_text, timestamp = signed_timestamp(headers, TIMESTAMP_HEADER)
        entries = header(headers, SIGNATURE_HEADER).split()
        lead = signed_lead(msg_id, timestamp_text)
        if not self._matches(entries[:MAX_SIGNATURES], lead, body):
            raise SignatureInvalid(f"no signature in the {SIGNATURE_HEADER} header matches")
        check_tolerance(timestamp, now, self.tolerance)

    def _matches(self, entries: list[str], lead: bytes, body: bytes) -> bool:
        v1: list[bytes] = []
        v1a: list[bytes] = []
        for entry in entries:
            # Repeated headers arrive joined with ", ": the comma left on an entry is not its own.
            version, comma, encoded = entry.rstrip(",").partition(",")
            signature = decode_base64(encoded) if comma else None
            if signature is None:
                continue
            if version == "v1":
                v1.append(signature)
            elif version == "v1a" and len(signature) == _ED25519_SIGNATURE_BYTES:
                v1a.append(signature)
        if v1 and matches_any((k.digest(lead, body) for k in self._keys.hmac), v1):
            return True
        if not (v1a and self._keys.public):
            return False
        content = lead + body
        return any(_ed25519_valid(key, sig, content) for key in self._keys.public for sig in v1a)

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        return checked_event_id(header(headers, ID_HEADER), f"the {ID_HEADER} header")

    def sign(
        self, body: bytes, *, event_id: str | None = None, timestamp: datetime | None = None
    ) -> dict[str, str]:
        """Headers for ``body``; without ``event_id`` a random ``msg_...`` id is made."""
        if self._keys.signer is None:
            raise UsageError("no secret of this scheme can sign: whpk_ public keys only verify")
        msg_id = event_id if event_id is not None else "msg_" + random_ids.token_urlsafe(18)
        timestamp_text = str(unix_seconds(timestamp))
        lead = signed_lead(msg_id, timestamp_text)
        version, key = self._keys.signer
        signature = key.digest(lead, body) if isinstance(key, HmacKey) else key.sign(lead + body)
        return {
            ID_HEADER: msg_id,
            TIMESTAMP_HEADER: timestamp_text,
            SIGNATURE_HEADER: f"{version},{encode_base64(signature)}",
        }


def _ed25519_valid(key: Ed25519PublicKey, signature: bytes, content: bytes) -> bool:
    # Only reached with a parsed public key, so the library is known to be installed.
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(signature, content)
    except InvalidSignature:
        return False
    return True


def _parse_keys(secrets: Sequence[str]) -> _Keys:
    hmac_keys: list[HmacKey] = []
    public: list[Ed25519PublicKey] = []
    signer: tuple[str, HmacKey | Ed25519PrivateKey] | None = None
    for number, secret in enumerate(checked_secrets(NAME, secrets), 1):
        what = f"secret #{number} of the {NAME} scheme"
        if secret.startswith("whpk_"):
            raw = decode_secret_base64(secret[5:], f"{what} (after 'whpk_')")
            public.append(_public_key(raw, what))
        elif secret.startswith("whsk_"):
            raw = decode_secret_base64(secret[5:], f"{what} (after 'whsk_')")
            private = _private_key(raw, what)
            public.append(private.public_key())
            signer = signer or ("v1a", private)
        else:
            encoded = secret.removeprefix("whsec_")
            key = HmacKey(decode_secret_base64(encoded, f"{what} (after 'whsec_')"), "sha256")
            hmac_keys.append(key)
            signer = signer or ("v1", key)
    return _Keys(hmac=tuple(hmac_keys), public=tuple(public), signer=signer)


def _public_key(raw: bytes, what: str) -> Ed25519PublicKey:
    with needs("ed25519", "a Standard Webhooks v1a (Ed25519) key"):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(raw) != 32:
        raise ConfigError(f"{what} must be a 32-byte Ed25519 public key, not {len(raw)} bytes")
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ConfigError(f"{what} is not a valid Ed25519 public key") from None


def _private_key(raw: bytes, what: str) -> Ed25519PrivateKey:
    with needs("ed25519", "a Standard Webhooks v1a (Ed25519) key"):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    if len(raw) not in (32, 64):
        raise ConfigError(
            f"{what} must be a 32-byte Ed25519 seed or a 64-byte seed + public key, "
            f"not {len(raw)} bytes"
        )
    private = Ed25519PrivateKey.from_private_bytes(raw[:32])
    derived = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    if len(raw) == 64 and raw[32:] != derived:
        raise ConfigError(f"{what}: its public half does not belong to its seed")
    return private
