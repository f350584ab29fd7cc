"""``PGONCE["DATABASE"]`` naming an alias other than ``default``: the claim, the view's ORM writes
on that alias, its on_commit hooks and ``enqueue()`` (which defaults to that alias) commit together,
once; a failing answer rolls all of it back.

The alias ``other`` is a second connection to the same test database (Django's ``TEST["MIRROR"]``),
as a project whose pgonce alias is a second entry for its main database has."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.outbox import enqueue
from tests.django.test_django import post, scalar, stored_keys

_default = connections.settings["default"]
connections.settings.setdefault(
    "other", {**_default, "TEST": {**_default.get("TEST", {}), "MIRROR": "default"}}
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
    pytest.mark.urls(__name__),
]

#: What the on_commit hooks of ``pay_on_other`` ran for, in order.
hooked: list[int] = []


def pay_on_other(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.using("other").create(principal="o", amount=1, currency="EUR")
    enqueue("payment", str(payment.pk), "payment.created", {"amount": 1})
    transaction.on_commit(lambda: hooked.append(payment.pk), using="other")
    return JsonResponse({"id": payment.pk}, status=int(request.GET.get("status", 201)))


urlpatterns = [path("other", pay_on_other)]


@pytest.fixture
def on_other(settings: Any) -> Iterator[None]:
    settings.PGONCE = {**settings.PGONCE, "DATABASE": "other"}
    hooked.clear()
    yield
    connections["other"].close()


@pytest.mark.usefixtures("on_other")
def test_the_claim_writes_hooks_and_event_on_another_alias_commit_together_once() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, "/other", key)
    assert first.status_code == 201
    payment = json.loads(first.content)["id"]
    assert hooked == [payment]
    again = post(client, "/other", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert hooked == [payment]
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1
    assert scalar("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s", str(payment)) == 1


@pytest.mark.usefixtures("on_other")
def test_a_failing_answer_on_another_alias_rolls_it_all_back() -> None:
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        assert post(client, "/other?status=503", key).status_code == 503
    assert hooked == []
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
