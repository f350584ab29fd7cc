"""``PGONCE["DATABASE"]`` on an alias with Django's connection pool (``OPTIONS["pool"]``, Django
5.1+): requests claim, commit and replay as on a plain connection, and a view that closes the
request's connection, which gives it back to the pool (rolled back there), is the
transaction-ended problem, never its success over writes that are gone; an inbox handler that
does it is a UsageError, and the batch writes nothing more on the connection the pool holds.

The alias ``pooled`` is a second connection to the same test database (Django's
``TEST["MIRROR"]``) with a pool of its own."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.inbox import process_batch
from pgonce.contrib.django.outbox import enqueue
from pgonce.errors import UsageError
from tests.django.test_django import _deliver, post, scalar, stored_keys

_default = connections.settings["default"]
connections.settings.setdefault(
    "pooled",
    {
        **_default,
        "OPTIONS": {**_default.get("OPTIONS", {}), "pool": {"min_size": 1, "max_size": 2}},
        "CONN_MAX_AGE": 0,
        "TEST": {**_default.get("TEST", {}), "MIRROR": "default"},
    },
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "pooled"]),
    pytest.mark.urls(__name__),
]


def pay(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.using("pooled").create(principal="p", amount=1, currency="EUR")
    enqueue("payment", str(payment.pk), "payment.created", {"amount": 1})
    return JsonResponse({"id": payment.pk}, status=int(request.GET.get("status", 201)))


def pay_and_close(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.using("pooled").create(principal="p", amount=1, currency="EUR")
    connections["pooled"].close()  # back to the pool, which rolls the transaction back
    return JsonResponse({"id": payment.pk}, status=201)


urlpatterns = [path("pay", pay), path("pay-and-close", pay_and_close)]


@pytest.fixture(autouse=True)
def pooled(settings: Any) -> Iterator[None]:
    settings.PGONCE = {**settings.PGONCE, "DATABASE": "pooled"}
    yield
    connections["pooled"].close()
    connections["pooled"].close_pool()


def test_a_pooled_alias_commits_the_claim_with_the_writes_and_replays() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, "/pay", key)
    assert first.status_code == 201
    again = post(client, "/pay", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1
    payment = json.loads(first.content)["id"]
    assert scalar("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s", str(payment)) == 1
    failing = uuid.uuid4().hex
    for _ in range(2):
        assert post(client, "/pay?status=503", failing).status_code == 503
    assert Payment.objects.count() == 1
    assert stored_keys(failing) == 0


def test_a_view_that_gives_the_connection_back_to_the_pool_is_a_problem_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The pool rolled the request back, payment and claim, and the client was told 201; the
    # claim was then released in a transaction of its own on the connection the pool held.
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        for _ in range(2):  # the key stays free: the retry runs the view again
            refused = post(client, "/pay-and-close", key)
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert "closed its connection" in caplog.text
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
    # The pool's connections are whole: the next request claims, commits and replays.
    fresh = uuid.uuid4().hex
    assert post(client, "/pay", fresh).status_code == 201
    assert post(client, "/pay", fresh).headers["Idempotent-Replayed"] == "true"
    assert Payment.objects.count() == 1


@pytest.mark.parametrize("then_raise", [False, True], ids=["returns", "raises"])
def test_an_inbox_handler_that_gives_the_connection_back_to_the_pool_is_a_usage_error(
    then_raise: bool,
) -> None:
    # The batch went on, on the connection the pool now held: it recorded the event as failed
    # in a transaction of its own there and committed it, and said nothing of the misuse.
    source = f"probe-{uuid.uuid4().hex[:8]}"
    _deliver({"kind": "a"}, {"kind": "close"}, {"kind": "b"}, source=source)
    closing = True

    def handler(event: Any) -> None:
        kind = event.payload["kind"]
        Payment.objects.using("pooled").create(principal=kind, amount=1, currency="EUR")
        if kind == "close" and closing:
            connections["pooled"].close()
            if then_raise:
                raise RuntimeError("after the close")

    with pytest.raises(UsageError, match="closed the connection"):
        process_batch(source, handler, using="pooled", now=datetime.now(UTC))
    assert Payment.objects.count() == 0
    # Nothing of the batch was recorded: every event is pending, none failed.
    assert (
        scalar(
            "SELECT count(*) FROM pgonce.inbox WHERE source = %s AND status = 'pending' "
            "AND attempts = 0",
            source,
        )
        == 3
    )
    closing = False
    assert process_batch(source, handler, using="pooled", now=datetime.now(UTC)) == 3
    assert sorted(Payment.objects.values_list("principal", flat=True)) == ["a", "b", "close"]
