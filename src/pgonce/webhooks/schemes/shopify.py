"""Shopify: ``X-Shopify-Hmac-Sha256: <base64>``, the HMAC-SHA256 of the raw body.

The key is the app's client secret (or the webhook signing secret) as UTF-8. Shopify signs no
timestamp, so no tolerance applies. The event id is the ``X-Shopify-Webhook-Id`` header, which
Shopify keeps across retries of a delivery; like GitHub's delivery id it is not covered by the
signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from pgonce.webhooks.schemes.common import DEFAULT_TOLERANCE
from pgonce.webhooks.schemes.generic_hmac import GenericHmac

NAME = "shopify"
SIGNATURE_HEADER = "x-shopify-hmac-sha256"
ID_HEADER = "x-shopify-webhook-id"
#: What the delivery is about, in headers only (the body does not name its topic or shop): kept
#: with the delivery, so that a source's ``event_type`` and its handlers can read them.
DESCRIPTION_HEADERS = (
    "x-shopify-topic",
    "x-shopify-shop-domain",
    "x-shopify-api-version",
    "x-shopify-event-id",
    "x-shopify-triggered-at",
)


class Shopify(GenericHmac):
    """The Shopify scheme, a preset of :class:`GenericHmac`; no timestamp, so no tolerance."""

    def __init__(
        self, secrets: Sequence[str], *, tolerance: timedelta | float = DEFAULT_TOLERANCE
    ) -> None:
        super().__init__(
            secrets,
            name=NAME,
            header=SIGNATURE_HEADER,
            encoding="base64",
            id_header=ID_HEADER,
            tolerance=tolerance,
        )
        self.header_names += DESCRIPTION_HEADERS
