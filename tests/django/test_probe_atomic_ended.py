"""A view under ``ATOMIC_REQUESTS`` that ends the request's transaction itself (raw
``ROLLBACK`` or ``COMMIT`` through its cursor, or the psycopg connection's own ``rollback()`` or
``commit()``) and then writes again: nothing written after the end commits, and the client gets
the problem answer of a transaction ended by the endpoint, logged as a ``UsageError``, never a
success nor a 503 telling it to retry."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


def end_then_write(request: HttpRequest) -> HttpResponse:
    Payment.objects.create(principal="before", amount=1, currency="EUR")
    how = request.GET["how"]
    if how in ("ROLLBACK", "COMMIT"):
        with connection.cursor() as cur:
            cur.execute(how)
    else:
        getattr(connection.connection, how)()
    payment = Payment.objects.create(principal="after", amount=1, currency="EUR")
    return JsonResponse({"id": payment.pk}, status=201)


urlpatterns = [path("end-then-write", end_then_write)]


@pytest.fixture
def atomic_requests_on() -> Iterator[None]:
    previous = connection.settings_dict["ATOMIC_REQUESTS"]
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = previous


@pytest.mark.usefixtures("atomic_requests_on")
@pytest.mark.parametrize("how", ["ROLLBACK", "COMMIT", "rollback", "commit"])
def test_writes_after_the_view_ended_the_transaction_are_refused_loudly(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        first = post(client, f"/end-then-write?how={how}", key)
    assert first.status_code == 500
    assert first.headers["Content-Type"] == "application/problem+json"
    assert json.loads(first.content)["title"] == "Transaction ended by the endpoint"
    assert "Idempotency-Key-Expires" not in first.headers
    assert "UsageError" in caplog.text
    # What ran after the end never commits.
    assert not Payment.objects.filter(principal="after").exists()
    committed = how.lower() == "commit"
    # A rollback took the claim with the first write; a commit committed both, and the claim
    # stays in flight, so that no retry makes that write again.
    assert Payment.objects.filter(principal="before").count() == int(committed)
    assert stored_keys(key) == int(committed)


@pytest.mark.parametrize("how", ["COMMIT", "commit"])
def test_without_atomic_requests_a_commit_then_writes_is_never_answered_as_a_success(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The writes after the end roll back: the view's 201 names a row that was never made, so it
    # is neither sent nor stored; the claim committed with the first write stays in flight.
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        first = post(client, f"/end-then-write?how={how}", key)
    assert first.status_code == 500
    assert json.loads(first.content)["title"] == "Transaction ended by the endpoint"
    assert "EndedThenWrote" in caplog.text  # a UsageError
    assert not Payment.objects.filter(principal="after").exists()
    assert Payment.objects.filter(principal="before").count() == 1
    assert stored_keys(key) == 1
