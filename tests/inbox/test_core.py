"""The inbox's pure decisions, without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgonce.core.channels import notify_channel
from pgonce.core.inbox import (
    MAX_ERROR_CHARS,
    DeadLetter,
    Ordering,
    Retry,
    RetryPolicy,
    after_failure,
    answer,
    backoff,
    describe_error,
    parse_json,
    stored_headers,
    validate_event_id,
    validate_ordering,
)
from pgonce.errors import BadPayload, ConfigError, UsageError
from pgonce.webhooks.source import Source
from tests.inbox.conftest import hmac_scheme

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = RetryPolicy(attempts=5, base=timedelta(seconds=2), cap=timedelta(seconds=10))


def test_backoff_doubles_up_to_the_cap_with_equal_jitter() -> None:
    assert backoff(POLICY, 1, 0.0) == timedelta(seconds=1)
    assert backoff(POLICY, 1, 0.5) == timedelta(seconds=1.5)
    assert backoff(POLICY, 2, 0.0) == timedelta(seconds=2)
    assert backoff(POLICY, 3, 0.0) == timedelta(seconds=4)
    assert backoff(POLICY, 4, 0.0) == timedelta(seconds=5)  # 16 s capped at 10, halved
    assert backoff(POLICY, 1000, 0.999) < timedelta(seconds=10)


@given(attempts=st.integers(1, 10_000), jitter=st.floats(0, 1, exclude_max=True))
def test_backoff_stays_between_half_the_delay_and_the_cap(attempts: int, jitter: float) -> None:
    delay = backoff(POLICY, attempts, jitter)
    assert timedelta(seconds=1) <= delay <= POLICY.cap


def test_after_failure_retries_until_the_last_attempt() -> None:
    assert after_failure(POLICY, 0, now=NOW, jitter=0.0) == Retry(NOW + timedelta(seconds=1))
    assert isinstance(after_failure(POLICY, 3, now=NOW), Retry)
    assert after_failure(POLICY, 4, now=NOW) == DeadLetter()
    assert after_failure(RetryPolicy(attempts=1), 0, now=NOW) == DeadLetter()


def test_bad_policies_and_jitter_are_refused() -> None:
    with pytest.raises(UsageError):
        RetryPolicy(attempts=0)
    with pytest.raises(UsageError):
        RetryPolicy(base=timedelta(seconds=5), cap=timedelta(seconds=1))
    with pytest.raises(UsageError):
        backoff(POLICY, 1, 1.0)
    with pytest.raises(UsageError):
        backoff(POLICY, 0, 0.5)


def test_describe_error_names_the_type_and_truncates() -> None:
    assert describe_error(ValueError("bad amount")) == "ValueError: bad amount"
    assert describe_error(KeyError()) == "KeyError"
    long = describe_error(RuntimeError("x" * 10_000))
    assert len(long) == MAX_ERROR_CHARS
    assert long.startswith("RuntimeError: xxx")


def test_event_ids_and_orderings_that_cannot_be_stored_are_bad_payloads() -> None:
    assert validate_event_id("evt_1") == "evt_1"
    for bad in ("", "a" * 513, "a\x00b"):
        with pytest.raises(BadPayload):
            validate_event_id(bad)
    assert validate_ordering(Ordering("cus_1", 3)) == Ordering("cus_1", 3)
    # A provider's numeric object id (Shopify's) names the object by its decimal text.
    assert validate_ordering(Ordering(820982911946154508, 3)) == Ordering("820982911946154508", 3)  # type: ignore[arg-type]
    for ordering in (Ordering(""), Ordering("k", 2**63), Ordering("k\x00"), Ordering(True)):  # type: ignore[arg-type]
        with pytest.raises(BadPayload):
            validate_ordering(ordering)


def test_parse_json_refuses_non_utf8_and_malformed_bodies() -> None:
    assert parse_json(b'{"a": [1]}') == {"a": [1]}
    for body in (b"\xff\xfe", b"{", b"", b"[" * 100_000):
        with pytest.raises(BadPayload):
            parse_json(body)


def test_stored_headers_keep_what_verification_needs_and_drop_credentials() -> None:
    headers = {"authorization": "Bearer x", "x-signature": "ab", "content-type": "a/b", "x-n": "1"}
    assert stored_headers(headers) == {"x-signature": "ab", "content-type": "a/b", "x-n": "1"}
    assert stored_headers(headers, ("x-signature",)) == {"x-signature": "ab", "content-type": "a/b"}


def test_a_scheme_that_lists_no_headers_never_has_a_shared_token_stored() -> None:
    # GitLab's X-Gitlab-Token carries the secret itself: the stored row must not hold it.
    headers = {
        "x-gitlab-token": "s3cret",
        "x-api-key": "k",
        "x-webhook-secret": "s",
        "x-auth-token": "t",
        "set-cookie": "c",
        "x-gitlab-event": "Push Hook",
        "content-type": "application/json",
    }
    assert stored_headers(headers) == {
        "x-gitlab-event": "Push Hook",
        "content-type": "application/json",
    }
    # A scheme that names a header it needs (to verify again) keeps it.
    assert stored_headers(headers, ("x-gitlab-token",))["x-gitlab-token"] == "s3cret"


def test_outcomes_map_to_statuses_and_the_channel_fits() -> None:
    assert [answer(o) for o in ("stored", "duplicate", "conflict", "gone")] == [200, 200, 409, 503]
    assert notify_channel("pgonce", "inbox") == "pgonce.inbox"
    assert notify_channel("pgonce", "outbox") == "pgonce.outbox"
    assert len(notify_channel("s" * 63, "inbox")) == 63


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": None}, "name must be a str, not None"),
        ({"scheme": "github"}, "scheme must be a signature scheme, not a str"),
        ({"body_limit": "1mb"}, "body_limit must be a whole number of bytes, not a str"),
        ({"handler_timeout": 30}, "handler_timeout must be a datetime.timedelta, not an int"),
        ({"retry": {"attempts": 3}}, "retry must be a RetryPolicy, not a dict"),
        ({"handler": "module.fn"}, "handler must be callable, not a str"),
        (
            {"handlers": {"push": None}, "event_type": lambda p, h: "push"},
            "the handler of event type 'push' must be callable, not None",
        ),
    ],
)
def test_a_source_of_the_wrong_types_is_refused_at_construction(
    options: dict[str, object], message: str
) -> None:
    """Each would fail later, untyped: at the first delivery, or the retry policy's attributes
    at the first failure, in the worker."""
    arguments: dict[str, object] = {"name": "s", "scheme": hmac_scheme(), **options}
    with pytest.raises(ConfigError, match=message):
        Source(**arguments)  # type: ignore[arg-type]


def test_sources_refuse_configuration_that_cannot_work() -> None:
    with pytest.raises(ConfigError):
        Source(name="has space", scheme=hmac_scheme())
    with pytest.raises(ConfigError):
        Source(name="s", scheme=hmac_scheme(), out_of_order="drop")  # no ordering extractor
    with pytest.raises(ConfigError):
        Source(name="s", scheme=hmac_scheme(), body_limit=0)
    with pytest.raises(ConfigError):
        Source(name="s", scheme=hmac_scheme(), head_failure="skip")  # type: ignore[arg-type]
