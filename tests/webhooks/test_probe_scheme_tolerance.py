"""A scheme built from its class (as ``pgonce.publishers.http`` builds ``StandardWebhooks``) with
a tolerance of 0, a negative one or seconds as a number was taken: 0 or less then refused every
authentic delivery as out of tolerance, and a number failed each verification with an
``AttributeError`` (answered 401 by the receiver, logged as a scheme failure), far from the
mistake. Each class now checks its tolerance as ``build_scheme`` does: seconds or a timedelta,
positive, else a :class:`~pgonce.errors.ConfigError` at once."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pgonce.errors import ConfigError
from pgonce.webhooks.schemes.generic_hmac import GenericHmac
from pgonce.webhooks.schemes.github import GitHub
from pgonce.webhooks.schemes.shopify import Shopify
from pgonce.webhooks.schemes.slack import Slack
from pgonce.webhooks.schemes.standard_webhooks import StandardWebhooks
from pgonce.webhooks.schemes.stripe import Stripe

NOW = datetime(2026, 1, 1, tzinfo=UTC)
BODY = b'{"id": "evt_1", "event_id": "Ev1"}'

CLASSES: dict[str, Callable[..., Any]] = {
    "stripe": lambda **kw: Stripe(["whsec_x"], **kw),
    "standard-webhooks": lambda **kw: StandardWebhooks(
        ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"], **kw
    ),
    "slack": lambda **kw: Slack(["s"], **kw),
    "github": lambda **kw: GitHub(["s"], **kw),
    "shopify": lambda **kw: Shopify(["s"], **kw),
    "generic-hmac": lambda **kw: GenericHmac(["s"], header="x-sig", timestamp_header="x-ts", **kw),
}


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize(
    ("tolerance", "match"),
    [
        (timedelta(0), "positive"),
        (0, "positive"),
        (timedelta(seconds=-1), "positive"),
        ("300", "seconds or a timedelta"),
        (True, "seconds or a timedelta"),
        (float("inf"), "out of range"),
    ],
    ids=["zero", "zero-seconds", "negative", "str", "bool", "inf"],
)
def test_a_tolerance_no_delivery_could_meet_is_refused_by_the_class(
    name: str, tolerance: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        CLASSES[name](tolerance=tolerance)


@pytest.mark.parametrize("name", ["stripe", "standard-webhooks", "slack", "generic-hmac"])
def test_a_tolerance_in_seconds_holds_as_a_timedelta_does(name: str) -> None:
    scheme = CLASSES[name](tolerance=60)
    assert scheme.tolerance == timedelta(seconds=60)
    fresh = scheme.sign(BODY, event_id="evt_1", timestamp=NOW - timedelta(seconds=59))
    scheme.verify(fresh, BODY, now=NOW)
