"""A view's outermost atomic() block marked for rollback when the view wrote outside it too:
before it, in an earlier block, or after it. Without the middleware those writes commit on their
own (autocommit) and only the block is undone; they must commit with the stored answer."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"


def _write(principal: str) -> int:
    return int(Payment.objects.create(principal=principal, amount=1, currency="EUR").pk)


def _undone_block() -> None:
    with transaction.atomic():
        _write("undone")
        transaction.set_rollback(True)


def write_before(request: HttpRequest) -> HttpResponse:
    kept = _write("kept")
    _undone_block()
    return JsonResponse({"id": kept}, status=201)


def block_before(request: HttpRequest) -> HttpResponse:
    with transaction.atomic():
        kept = _write("kept")
    _undone_block()
    return JsonResponse({"id": kept}, status=201)


def write_after(request: HttpRequest) -> HttpResponse:
    _undone_block()
    return JsonResponse({"id": _write("kept")}, status=201)


def only_the_block(request: HttpRequest) -> HttpResponse:
    _undone_block()
    return JsonResponse({"saved": False}, status=200)


urlpatterns = [
    path("write-before", transaction.non_atomic_requests(write_before)),
    path("block-before", transaction.non_atomic_requests(block_before)),
    path("write-after", transaction.non_atomic_requests(write_after)),
    path("only-the-block", transaction.non_atomic_requests(only_the_block)),
]


@pytest.mark.parametrize("route", ["/write-before", "/block-before", "/write-after"])
def test_a_write_outside_the_undone_block_commits_with_the_stored_answer(
    route: str, atomic_requests: bool
) -> None:
    # The whole request was rolled back and the answer not stored: the client was told 201 for
    # a payment that never committed, every time it retried.
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, route, key)
    assert first.status_code == 201
    again = post(client, route, key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert list(Payment.objects.values_list("principal", flat=True)) == ["kept"]
    assert Payment.objects.get().pk == first.json()["id"]
    assert stored_keys(key) == 1


def test_a_view_whose_one_block_is_undone_is_still_not_stored(atomic_requests: bool) -> None:
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        answered = post(client, "/only-the-block", key)
        assert answered.status_code == 200
        assert "Idempotent-Replayed" not in answered.headers
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
