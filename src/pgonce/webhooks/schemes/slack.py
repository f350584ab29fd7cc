"""Slack: ``X-Slack-Signature: v0=<hex>`` over ``v0:{X-Slack-Request-Timestamp}:{raw body}``.

HMAC-SHA256 keyed with the app's signing secret as UTF-8; the timestamp is held to the tolerance
in both directions. The event id is the Events API body's ``event_id``, covered by the signature
and kept across Slack's retries. Bodies that carry none -- the ``url_verification`` handshake, or
the form-encoded bodies of slash commands and interactivity -- have no id (the inbox falls back to
a hash of the body); a body that starts like a JSON object must be one. The handshake is answered
with its challenge (:meth:`Slack.handshake`), not stored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta

from pgonce.errors import BadPayload
from pgonce.webhooks.schemes.base import Headers
from pgonce.webhooks.schemes.common import (
    DEFAULT_TOLERANCE,
    json_event_id,
    json_object,
)
from pgonce.webhooks.schemes.generic_hmac import GenericHmac

NAME = "slack"
SIGNATURE_HEADER = "x-slack-signature"
TIMESTAMP_HEADER = "x-slack-request-timestamp"


class Slack(GenericHmac):
    """The Slack scheme: a preset of :class:`GenericHmac` with its own event id."""

    def __init__(
        self, secrets: Sequence[str], *, tolerance: timedelta | float = DEFAULT_TOLERANCE
    ) -> None:
        super().__init__(
            secrets,
            name=NAME,
            header=SIGNATURE_HEADER,
            prefix="v0=",
            encoding="hex",
            timestamp_header=TIMESTAMP_HEADER,
            signed_prefix="v0:{timestamp}:",
            tolerance=tolerance,
        )

    def handshake(self, body: bytes) -> bytes | None:
        """The answer to Slack's ``url_verification`` handshake (its ``challenge`` echoed back,
        which is how Slack accepts a Request URL), or None for any other body. Called only after
        :meth:`verify` passed; the handshake is answered, not stored as an event."""
        if b'"url_verification"' not in body or not body.lstrip().startswith(b"{"):
            return None
        try:
            document = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(document, dict) or document.get("type") != "url_verification":
            return None
        challenge = document.get("challenge")
        if not isinstance(challenge, str):
            raise BadPayload("the url_verification body has no challenge string")
        return json.dumps({"challenge": challenge}).encode()

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        if not body.lstrip().startswith(b"{"):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                raise BadPayload("the body is not UTF-8") from None
            return None
        return json_event_id(json_object(body), "event_id")
