"""A source's extractors are checked where the source is built. A field name given instead of a
function (``ordering="customer"``) was accepted, and then every delivery was answered 400 (the
provider gives up on the endpoint and the events are never stored), or every event failed."""

from __future__ import annotations

from typing import Any

import pytest

from pgonce.errors import ConfigError
from pgonce.webhooks.source import Source
from tests.inbox.conftest import hmac_scheme, record_effect


@pytest.mark.parametrize("option", ["ordering", "event_type", "event_id_fallback"])
def test_an_extractor_that_is_not_callable_is_refused_at_construction(option: str) -> None:
    arguments: dict[str, Any] = {"name": "s", "scheme": hmac_scheme(), option: "type"}
    if option == "event_type":
        arguments["handlers"] = {"a": record_effect}
    with pytest.raises(ConfigError, match=f"{option} must be callable, not a str"):
        Source(**arguments)
