"""``settings.PGONCE`` mistakes as the outbox and the inbox meet them (they are used without the
middleware, and need no SCOPE), and the middleware's own check of odd keys and ROUTES values."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings

from pgonce.contrib.django import conf
from pgonce.contrib.django.inbox import process_batch
from pgonce.contrib.django.outbox import enqueue
from pgonce.errors import ConfigError

pytestmark = pytest.mark.django_db(transaction=True)

MISTAKES = [
    pytest.param({"SCHEMA": 5}, "PGONCE['SCHEMA'] must be a string", id="schema-not-a-string"),
    pytest.param({"SCHEMA": "Bad-Name"}, "schema name 'Bad-Name' is not allowed", id="schema-name"),
    pytest.param({"DATABASE": 5}, "PGONCE['DATABASE'] must be a non-empty string", id="database"),
    pytest.param({"DATABASE": "nope"}, "'nope', which settings.DATABASES", id="unknown-alias"),
    pytest.param(["SCHEMA"], "settings.PGONCE must be a dict", id="not-a-dict"),
]


@pytest.mark.parametrize(("pgonce", "said"), MISTAKES)
def test_enqueue_names_the_setting_that_is_wrong(pgonce: Any, said: str) -> None:
    # It was a bare TypeError or AttributeError from deep inside the write, Django's
    # ConnectionDoesNotExist, or a schema name every other entry point refuses.
    with (
        override_settings(PGONCE=pgonce),
        transaction.atomic(),
        pytest.raises(ConfigError, match=r"settings\.PGONCE") as raised,
    ):
        enqueue("payment", "1", "payment.created", {})
    assert said in str(raised.value)


@pytest.mark.parametrize(("pgonce", "said"), MISTAKES)
def test_process_batch_names_the_setting_that_is_wrong(pgonce: Any, said: str) -> None:
    with (
        override_settings(PGONCE=pgonce),
        pytest.raises(ConfigError, match=r"settings\.PGONCE") as raised,
    ):
        process_batch("refunds", lambda event: None)
    assert said in str(raised.value)


def test_an_unknown_key_that_is_not_a_string_is_listed_not_a_type_error() -> None:
    raw: dict[Any, Any] = {
        "SCOPE": "pgonce.contrib.django.scopes.user_scope",
        1: True,
        "TIMEOUT": 5,
    }
    with pytest.raises(ConfigError, match="unknown PGONCE settings: 1, TIMEOUT"):
        conf.load(raw)


def test_a_routes_value_that_is_not_a_list_is_named_as_written() -> None:
    raw = {"SCOPE": "pgonce.contrib.django.scopes.user_scope", "ROUTES": {"/webhooks": "POST"}}
    with pytest.raises(ConfigError) as raised:
        conf.load(raw)
    assert "PGONCE['ROUTES']['/webhooks'] must be a list of HTTP methods" in str(raised.value)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        pytest.param({"RETENTION": 10**12}, "at most 100 years", id="retention-past-year-9999"),
        pytest.param({"WAIT": 0.01}, "at least 100 ms", id="wait-too-short"),
        pytest.param({"WAIT": 10**8}, "at most 2147483647 ms", id="wait-too-long"),
    ],
)
def test_a_duration_out_of_range_is_listed_with_the_other_problems(
    setting: dict[str, Any], said: str
) -> None:
    # A RETENTION past year 9999 passed: every covered request committed, then was answered
    # Django's 500 page (the Idempotency-Key-Expires date could not be written). A WAIT out of
    # the key store's bounds was its UsageError, apart from the list of the other problems.
    raw = {"SCOPE": "pgonce.contrib.django.scopes.user_scope", "COLOUR": 1, **setting}
    with pytest.raises(ConfigError) as raised:
        conf.load(raw)
    assert said in str(raised.value)
    assert "COLOUR" in str(raised.value)


async def async_scope(request: Any) -> str:
    return "principal:async"


def test_an_async_scope_function_is_refused_at_start() -> None:
    # It was accepted, then every covered request was Django's 500 page with pgonce's "the
    # scope must be a str, not coroutine" and a coroutine never awaited.
    with pytest.raises(ConfigError, match="not async def"):
        conf.load({"SCOPE": f"{__name__}.async_scope"})
