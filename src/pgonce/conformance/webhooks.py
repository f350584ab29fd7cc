"""The webhook receiver checks: what a safe receiver must do with deliveries, judged from outside.

The kit signs deliveries the way the provider does (pgonce's signer for the scheme, and the
provider's own library where one is published: :mod:`.providers`) with the secret it is given,
sends them to the one endpoint URL (and, for the unknown-source check, to a sibling path whose
last segment names no source), and judges the answers and the effect count.

Delivery bodies are deliberately not in canonical form (spaces, ``\\u`` escapes): a receiver that
verifies a parsed and re-serialized body instead of the raw bytes refuses them, as it would refuse
real deliveries whenever the provider's serializer and its own disagree.

Sources cited by the checks: the Standard Webhooks specification (standardwebhooks.com), Stripe's
webhook docs (docs.stripe.com/webhooks), GitHub's (docs.github.com/webhooks), Slack's request
verification docs (api.slack.com/authentication/verifying-requests-from-slack), and RFC 9110 /
RFC 9457 for statuses and problem documents.
"""

from __future__ import annotations

import contextlib
import time

from pgonce.conformance import webhook_deliveries, webhook_signatures
from pgonce.conformance.effects import Effects, settled_count
from pgonce.conformance.report import Report
from pgonce.conformance.runner import DEFAULT_BUDGET, client, no_answer, request, within
from pgonce.conformance.webhook_run import WebhookRun, WebhookTarget, suite
from pgonce.core.urls import public
from pgonce.errors import UsageError
from pgonce.extras import needs
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.schemes.base import SigningScheme

with needs("http", "pgonce conformance"):
    import httpx

#: The checks' modules, imported for the checks they register on :data:`suite` (signatures first).
CHECKS = (webhook_signatures, webhook_deliveries)

__all__ = ["CHECKS", "WebhookTarget", "check_webhooks", "suite"]


def scheme_of(target: WebhookTarget) -> SigningScheme:
    """The scheme the kit signs with; bad configuration is a :class:`ConfigError` here."""
    scheme = build_scheme(
        target.scheme, target.secret, tolerance=target.tolerance, options=target.options
    )
    if not hasattr(scheme, "sign"):
        raise UsageError(f"the {target.scheme} scheme cannot sign")
    return scheme


async def check_webhooks(
    target: WebhookTarget,
    *,
    effects: Effects | None = None,
    budget: float = DEFAULT_BUDGET,
    only: tuple[str, ...] = (),
    http: httpx.AsyncClient | None = None,
) -> Report:
    """Run the webhook checks against ``target``; ``effects`` counts events really handled.

    Raises :class:`~pgonce.errors.UsageError` when the endpoint cannot be reached at all.
    """
    scheme = scheme_of(target)
    async with contextlib.AsyncExitStack() as stack:
        session = http if http is not None else await stack.enter_async_context(client())
        run = WebhookRun(target, session, effects, scheme)
        started = time.monotonic()
        try:
            await within(
                request(session, "OPTIONS", target.url),
                budget,
                f"cannot reach {public(target.url)}",
            )
        except httpx.HTTPError as error:
            raise UsageError(no_answer(error, target.url)) from None
        if effects is not None:
            run.start_count = await within(
                settled_count(effects, reach=0, within=0, settle=target.settle),
                budget - (time.monotonic() - started),
                "cannot read the effect count",
            )
        left = budget - (time.monotonic() - started)
        return await suite.run(run, target.url, budget=left, only=only)
