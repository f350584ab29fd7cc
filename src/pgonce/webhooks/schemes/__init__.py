"""Signature schemes, one small module each; every one implements :class:`~.base.SigningScheme`.

:func:`build_scheme` is the one way configuration becomes a scheme::

    scheme = build_scheme("stripe", ["whsec_..."], tolerance=timedelta(minutes=5))
    scheme.verify(headers, body, now=datetime.now(UTC))   # raises a WebhookError, or passes
    event_id = delivery_event_id(scheme, headers, body)    # the provider's id, or a body hash
    headers = scheme.sign(body, event_id="evt_1")          # the inverse, for `pgonce send`

Bad configuration -- an unknown scheme, an option it does not take, a ``whsec_`` secret that is
not base64 -- raises :class:`~pgonce.errors.ConfigError` here, before anything is received.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

from pgonce.core.checks import describe
from pgonce.errors import ConfigError
from pgonce.webhooks.schemes import generic_hmac, github, shopify, slack, standard_webhooks, stripe
from pgonce.webhooks.schemes.base import (
    Headers,
    Scheme,
    SigningScheme,
    delivery_event_id,
    fallback_event_id,
)
from pgonce.webhooks.schemes.common import DEFAULT_TOLERANCE, checked_tolerance

__all__ = [
    "DEFAULT_TOLERANCE",
    "SCHEMES",
    "Headers",
    "Scheme",
    "SigningScheme",
    "build_scheme",
    "delivery_event_id",
    "fallback_event_id",
]

_Factory = Callable[[Sequence[str], timedelta, Mapping[str, object]], SigningScheme]


def _without_options(cls: Callable[..., SigningScheme], name: str) -> _Factory:
    def factory(
        secrets: Sequence[str], tolerance: timedelta, options: Mapping[str, object]
    ) -> SigningScheme:
        if options:
            raise ConfigError(
                f"the {name} scheme takes no options, but got: {', '.join(sorted(options))}"
            )
        return cls(secrets, tolerance=tolerance)

    return factory


#: Scheme names, as written in configuration, and what builds each.
SCHEMES: dict[str, _Factory] = {
    standard_webhooks.NAME: _without_options(
        standard_webhooks.StandardWebhooks, "standard-webhooks"
    ),
    stripe.NAME: _without_options(stripe.Stripe, stripe.NAME),
    github.NAME: _without_options(github.GitHub, github.NAME),
    shopify.NAME: _without_options(shopify.Shopify, shopify.NAME),
    slack.NAME: _without_options(slack.Slack, slack.NAME),
    generic_hmac.NAME: generic_hmac.build,
}


def build_scheme(
    name: str,
    secrets: str | Sequence[str],
    *,
    tolerance: timedelta | float | None = None,
    options: Mapping[str, object] | None = None,
) -> SigningScheme:
    """The scheme ``name`` with its active ``secrets`` (any one may match; the first signs).

    ``tolerance`` is a timedelta or seconds; ``None`` means :data:`DEFAULT_TOLERANCE` (five
    minutes). Schemes without a signed timestamp (GitHub, Shopify, generic HMAC without a
    timestamp header) accept it and do not use it. ``options`` are the scheme's own settings;
    only ``generic-hmac`` takes any (see :mod:`.generic_hmac`).
    """
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"the options of the {name} scheme must be a mapping of option names to values, "
            f"not {describe(options)}"
        )
    factory = SCHEMES.get(name)
    if factory is None:
        raise ConfigError(
            f"unknown webhook signature scheme {name!r}; known schemes: {', '.join(SCHEMES)}"
        )
    return factory(
        [secrets] if isinstance(secrets, str) else secrets,
        checked_tolerance(name, tolerance),
        dict(options or {}),
    )
