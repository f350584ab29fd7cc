"""A black-box conformance kit: does a running endpoint really behave idempotently?

``pgonce conformance http URL`` checks an endpoint that takes an ``Idempotency-Key``;
``pgonce conformance webhooks URL`` checks a webhook receiver. Each check is a named behaviour with
a one-line reason and its source (the IETF draft, a provider's documentation, an RFC); each result
is PASS, FAIL or SKIP with the evidence seen on the wire. Effects are counted through a small
contract the application exposes (:mod:`.effects`), so a duplicate effect is seen, not guessed.

The kit sends traffic only to the URL it is given (its origin, and the paths named on the command
line), runs within a time budget, and never shows a secret. It needs ``pgonce[http]`` (httpx).
"""

from __future__ import annotations

from pgonce.extras import require

require("http", "pgonce conformance")

from pgonce.conformance.effects import Effects, SqlEffects, UrlEffects  # noqa: E402
from pgonce.conformance.http import HttpTarget, check_http  # noqa: E402
from pgonce.conformance.report import Check, Report, Result  # noqa: E402
from pgonce.conformance.webhooks import WebhookTarget, check_webhooks  # noqa: E402

__all__ = [
    "Check",
    "Effects",
    "HttpTarget",
    "Report",
    "Result",
    "SqlEffects",
    "UrlEffects",
    "WebhookTarget",
    "check_http",
    "check_webhooks",
]
