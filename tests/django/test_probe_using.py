"""A ``using=`` that is not an alias of ``settings.DATABASES`` (a misspelt name, or the
connection object itself) is a UsageError naming it and the aliases there are, not Django's
ConnectionDoesNotExist or an AttributeError from its connection handler."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection, transaction

from pgonce.contrib.django.inbox import process_batch
from pgonce.contrib.django.outbox import enqueue
from pgonce.errors import UsageError
from tests.django.test_django import scalar

pytestmark = pytest.mark.django_db(transaction=True)

WRONG = [pytest.param("defualt", id="misspelt"), pytest.param(connection, id="a-connection")]


@pytest.mark.parametrize("using", WRONG)
def test_enqueue_names_a_using_that_is_not_an_alias(using: Any) -> None:
    aggregate = uuid.uuid4().hex
    with (
        transaction.atomic(),
        pytest.raises(UsageError, match=r"is not a database alias.*'default'"),
    ):
        enqueue("payment", aggregate, "payment.created", {}, using=using)
    assert scalar("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s", aggregate) == 0


@pytest.mark.parametrize("using", WRONG)
def test_process_batch_names_a_using_that_is_not_an_alias(using: Any) -> None:
    with pytest.raises(UsageError, match=r"is not a database alias.*'default'"):
        process_batch("refunds", lambda event: None, using=using)
