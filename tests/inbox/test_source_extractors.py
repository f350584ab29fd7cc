"""A source's extractors are checked where the source is built. A field name given instead of a
function (``ordering="customer"``) was accepted, and then every delivery was answered 400 (the
provider gives up on the endpoint and the events are never stored), or every event failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pgonce.core.inbox import RetryPolicy
from pgonce.errors import ConfigError, UsageError
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import hmac_scheme, record_effect, source


@pytest.mark.parametrize("option", ["ordering", "event_type", "event_id_fallback"])
def test_an_extractor_that_is_not_callable_is_refused_at_construction(option: str) -> None:
    arguments: dict[str, Any] = {"name": "s", "scheme": hmac_scheme(), option: "type"}
    if option == "event_type":
        arguments["handlers"] = {"a": record_effect}
    with pytest.raises(ConfigError, match=f"{option} must be callable, not a str"):
        Source(**arguments)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: RetryPolicy(attempts="3"),  # type: ignore[arg-type]
            "attempts must be a whole number, not a str",
        ),
        (
            lambda: RetryPolicy(attempts=2.5),  # type: ignore[arg-type]
            "attempts must be a whole number, not a float",
        ),
        (
            lambda: RetryPolicy(base=5),  # type: ignore[arg-type]
            "base must be a datetime.timedelta, not an int",
        ),
        (
            lambda: RetryPolicy(cap=60.0),  # type: ignore[arg-type]
            "cap must be a datetime.timedelta, not a float",
        ),
        (lambda: worker(batch_size="50"), "batch_size must be a whole number"),
        (lambda: worker(poll_interval=1), "poll_interval must be a datetime.timedelta"),
        (lambda: worker(shutdown_timeout=30), "shutdown_timeout must be a datetime.timedelta"),
        (lambda: receiver(max_batch="200"), "max_batch must be a whole number"),
        (lambda: receiver(flushers=2.0), "flushers must be a whole number"),
    ],
)
def test_settings_of_the_wrong_type_are_a_usage_error_at_the_call(
    build: Callable[[], object], message: str
) -> None:
    """They were a TypeError of a comparison, or (a shutdown_timeout in seconds) an
    AttributeError only when the worker was being stopped."""
    with pytest.raises(UsageError, match=message):
        build()


def worker(**options: Any) -> InboxWorker:
    return InboxWorker([source()], dsn="postgresql://", **options)


def receiver(**options: Any) -> InboxReceiver:
    return InboxReceiver([source()], dsn="postgresql://", **options)


@pytest.mark.parametrize("prefix", ["webhooks", "hooks/in"])
def test_a_receiver_prefix_without_its_leading_slash_is_refused(prefix: str) -> None:
    """Request paths start with "/": such a prefix matched none, and every delivery was 404."""
    with pytest.raises(UsageError, match="the prefix must start with '/'"):
        receiver(prefix=prefix)


@pytest.mark.parametrize("prefix", ["", "/", "/webhooks", "/hooks/in/"])
def test_receiver_prefixes_that_work_are_accepted(prefix: str) -> None:
    receiver(prefix=prefix)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_json_required_that_is_not_a_bool_is_refused(value: object) -> None:
    """ "false" from a configuration file was read as true (and 0 as false), silently."""
    with pytest.raises(ConfigError, match="json_required must be True or False"):
        Source(name="s", scheme=hmac_scheme(), json_required=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", ["header", 5, [("header", "x-signature")]])
def test_scheme_options_that_are_not_a_mapping_are_a_config_error(options: object) -> None:
    """They were a ValueError or a TypeError of dict(), or (pairs) accepted by accident."""
    with pytest.raises(ConfigError, match="must be a mapping of option names to values"):
        build_scheme("generic-hmac", ["s"], options=options)  # type: ignore[arg-type]


def test_a_lone_source_instead_of_a_list_is_a_config_error() -> None:
    """It was a TypeError ('Source' object is not iterable) out of the receiver's constructor."""
    with pytest.raises(ConfigError, match="must be a list of Source, not a Source"):
        InboxReceiver(source(), dsn="postgresql://")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a list of Source, not a Source"):
        InboxWorker(source(), dsn="postgresql://")  # type: ignore[arg-type]
