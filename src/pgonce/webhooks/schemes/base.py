"""The contract every signature scheme implements.

A scheme verifies a delivery on its **raw bytes** before anything else looks at them, in constant
time, accepting any of several active secrets (rotation), and names the provider's event id. It
raises only :class:`~pgonce.errors.WebhookError` subclasses -- never ``ValueError`` or
``UnicodeDecodeError`` -- so that bad input becomes a 4xx, never a 500.

:class:`SigningScheme` extends the contract with the inverse of verification (``sign``) and the
names of the headers a scheme reads; every scheme pgonce ships implements it.
:func:`delivery_event_id` gives the id the inbox claims on: the provider's, or a hash of the body.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

from pgonce.core.fingerprint import fingerprint

#: Request headers with lower-case names. Repeated headers are joined with ", " (RFC 9110).
Headers = Mapping[str, str]


class Scheme(Protocol):
    #: The scheme's name in configuration: "standard-webhooks", "stripe", "github", ...
    name: str

    def verify(self, headers: Headers, body: bytes, *, now: datetime) -> None:
        """Raise :class:`~pgonce.errors.SignatureInvalid` or
        :class:`~pgonce.errors.TimestampOutOfTolerance` unless the delivery is authentic and
        fresh. ``now`` is a parameter so that tests set the clock."""
        ...

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        """The provider's event id, or ``None`` when this delivery carries none (the inbox then
        falls back to a hash of retry-stable fields). Called only after :meth:`verify` passed;
        may raise :class:`~pgonce.errors.BadPayload` when the id must come from a malformed body."""
        ...


class Handshaking(Protocol):
    """A scheme whose provider sends handshakes to a new endpoint (Slack's url_verification)."""

    def handshake(self, body: bytes) -> bytes | None:
        """The JSON answer to a verified delivery that is the provider's handshake, not an event
        (nothing is stored for it); None for an event."""
        ...


class SigningScheme(Scheme, Protocol):
    """A scheme that can also sign: what ``pgonce send`` and tests use to make deliveries."""

    #: Lower-case names of the headers the inbox keeps with the raw body: those :meth:`verify`
    #: and :meth:`event_id` read, so that a stored delivery can be verified again, and those that
    #: alone say what a delivery is about (GitHub's ``x-github-event``, Shopify's
    #: ``x-shopify-topic``), for a source's ``event_type`` and its handlers.
    header_names: tuple[str, ...]

    def sign(
        self, body: bytes, *, event_id: str | None = None, timestamp: datetime | None = None
    ) -> dict[str, str]:
        """The headers (lower-case names) that make ``body`` a delivery :meth:`verify` accepts.

        Signs with the first configured secret that can sign. ``timestamp`` defaults to now and
        is ignored by schemes without one; ``event_id`` goes into the scheme's id header, and is
        ignored where the id lives in the body (Stripe, Slack).
        """
        ...


#: Prefix of a fallback event id, so that it can never be mistaken for a provider's id.
FALLBACK_PREFIX = "sha256:"


def fallback_event_id(body: bytes) -> str:
    """The event id of a delivery whose provider sends none: a hash of its raw body.

    The body is the one part every provider keeps identical across retries (timestamps and
    signatures change with each attempt), and it is authenticated. Two different events with
    byte-identical bodies and no id are therefore one event; providers that send no id put a
    unique field in the body.
    """
    return FALLBACK_PREFIX + fingerprint(b"pgonce webhook event", body).hex()


def delivery_event_id(scheme: Scheme, headers: Headers, body: bytes) -> str:
    """The id the inbox claims on: the provider's event id, else :func:`fallback_event_id`.

    Call it only after ``scheme.verify`` passed; it may raise :class:`~pgonce.errors.BadPayload`.
    """
    provided = scheme.event_id(headers, body)
    return fallback_event_id(body) if provided is None else provided
