"""The Idempotency-Key checks: what a retry-safe endpoint must do, judged from outside.

The kit sends the request it is given (method, body, headers) to one endpoint, with new keys,
and judges the answers and the effect count (:mod:`pgonce.conformance.effects`). Requests go to
the endpoint's origin only: the endpoint itself, and the paths named with ``--fail-path``,
``--cookie-path``, ``--slow-path`` and ``--safe-path``.

Sources cited by the checks:

- the IETF draft: draft-ietf-httpapi-idempotency-key-header (the ``Idempotency-Key`` field, an
  RFC 8941 sf-string; errors 400, 409 and 422; the fingerprint; an expiry policy);
- Stripe's documented semantics (docs.stripe.com/api/idempotent_requests: keys of up to 255
  characters, parameters compared, results saved once the endpoint began);
- RFC 9110 (safe methods, ``Retry-After``), RFC 9457 (problem details), RFC 6265 (cookies).
"""

from __future__ import annotations

import contextlib
import time

from pgonce.conformance import http_keys, http_replays
from pgonce.conformance.effects import Effects
from pgonce.conformance.http_run import HttpRun, HttpTarget, new_key, suite
from pgonce.conformance.report import Report
from pgonce.conformance.runner import (
    DEFAULT_BUDGET,
    RateLimited,
    client,
    no_answer,
    redirected,
    server_failed,
    shown,
    within,
)
from pgonce.core.urls import public
from pgonce.errors import UsageError
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    import httpx

#: The checks' modules, imported for the checks they register on :data:`suite` (keys first).
CHECKS = (http_keys, http_replays)

__all__ = ["CHECKS", "HttpTarget", "check_http", "suite"]


async def check_http(
    target: HttpTarget,
    *,
    effects: Effects | None = None,
    budget: float = DEFAULT_BUDGET,
    only: tuple[str, ...] = (),
    http: httpx.AsyncClient | None = None,
) -> Report:
    """Run the HTTP checks against ``target``; ``effects`` counts what really happened.

    Raises :class:`~pgonce.errors.UsageError` when the endpoint cannot be judged at all: it is
    unreachable, or the request the kit was given does not succeed with a new key.
    """
    async with contextlib.AsyncExitStack() as stack:
        session = http if http is not None else await stack.enter_async_context(client())
        run = HttpRun(target, session, effects)
        started = time.monotonic()
        try:
            first = await within(
                run.send(new_key()),
                budget,
                f"cannot reach {public(target.url)}",
            )
        except httpx.HTTPError as error:
            raise UsageError(no_answer(error, target.url)) from None
        except RateLimited as error:
            raise UsageError(
                f"{target.method} {public(target.url)} with a new key: {error}"
            ) from None
        if first.status_code == 429:
            raise UsageError(
                f"{target.method} {public(target.url)} with a new key answered 429 Too Many "
                "Requests without a Retry-After: the endpoint is rate limited; run the kit where "
                "it is not"
            )
        if server_failed(first):
            # Not the request's fault: nothing can be judged while the server fails.
            raise UsageError(
                f"{target.method} {public(target.url)} with a new key answered "
                f"{first.status_code}, a server failure: the endpoint must succeed (2xx) before "
                f"its idempotency can be judged ({shown(first)})"
            )
        if redirect := redirected(first):
            raise UsageError(
                f"{target.method} {public(target.url)} with a new key answered "
                f"{first.status_code}, {redirect}: give the URL the endpoint really answers on"
            )
        if not first.is_success:
            raise UsageError(
                f"{target.method} {public(target.url)} with a new key answered "
                f"{first.status_code}, not 2xx: give the --body and --header that the endpoint "
                "accepts"
            )
        # The count contract holds before anything is judged.
        left = budget - (time.monotonic() - started)
        await within(run.count(), left, "cannot read the effect count")
        left = budget - (time.monotonic() - started)
        return await suite.run(run, target.url, budget=left, only=only)
