"""GitHub: ``X-Hub-Signature-256: sha256=<hex>``, the HMAC-SHA256 of the raw body.

The key is the webhook's secret as UTF-8. GitHub signs no timestamp, so no tolerance applies; the
event id is the ``X-GitHub-Delivery`` header (a GUID that stays the same when a delivery is
redelivered). That header is **not** covered by the signature: a captured delivery replayed with
another delivery id verifies, and only the body tells the two apart. The legacy SHA-1
``X-Hub-Signature`` header is not accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from pgonce.webhooks.schemes.common import DEFAULT_TOLERANCE
from pgonce.webhooks.schemes.generic_hmac import GenericHmac

NAME = "github"
SIGNATURE_HEADER = "x-hub-signature-256"
ID_HEADER = "x-github-delivery"
#: What the delivery is about, in headers only (the body does not name its event): kept with the
#: delivery, so that a source's ``event_type`` and its handlers can read them.
DESCRIPTION_HEADERS = (
    "x-github-event",
    "x-github-hook-id",
    "x-github-hook-installation-target-id",
    "x-github-hook-installation-target-type",
)


class GitHub(GenericHmac):
    """The GitHub scheme, a preset of :class:`GenericHmac`; no timestamp, so no tolerance."""

    def __init__(
        self, secrets: Sequence[str], *, tolerance: timedelta | float = DEFAULT_TOLERANCE
    ) -> None:
        super().__init__(
            secrets,
            name=NAME,
            header=SIGNATURE_HEADER,
            prefix="sha256=",
            encoding="hex",
            id_header=ID_HEADER,
            tolerance=tolerance,
        )
        self.header_names += DESCRIPTION_HEADERS
