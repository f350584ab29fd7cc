"""The contract every signature scheme implements.

A scheme verifies a delivery on its **raw bytes** before anything else looks at them, in constant
time, accepting any of several active secrets (rotation), and names the provider's event id. It
raises only :class:`~pgonce.errors.WebhookError` subclasses -- never ``ValueError`` or
``UnicodeDecodeError`` -- so that bad input becomes a 4xx, never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

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
