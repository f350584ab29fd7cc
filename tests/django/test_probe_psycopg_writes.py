"""Views that write through psycopg calls Django's execute wrappers never see:
``cursor.callproc()`` and a COPY (``cursor.copy()``). Their 2xx answer must commit with the
writes and be stored, never go out over writes rolled back (a retry would pay again)."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

FUNCTION = """
CREATE OR REPLACE FUNCTION probe_pay(amount bigint) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO payments (principal, amount, currency, created_at)
    VALUES ('callproc', amount, 'EUR', now()) RETURNING id
$$
"""


def callproc(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cur:
        cur.callproc("probe_pay", [7])
        (payment,) = cur.fetchone()
    return JsonResponse({"id": payment}, status=201)


def copy(request: HttpRequest) -> HttpResponse:
    sql = "COPY payments (principal, amount, currency, created_at) FROM STDIN"
    with connection.cursor() as cur, cur.copy(sql) as rows:
        rows.write_row(("copy", 7, "EUR", "2026-01-01T00:00:00Z"))
    return JsonResponse({"copied": 1}, status=201)


def refuse_after_callproc(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cur:
        cur.callproc("probe_pay", [7])
    return JsonResponse({"error": "refused"}, status=409)


urlpatterns = [
    path("callproc", callproc),
    path("copy", copy),
    path("refuse-after-callproc", refuse_after_callproc),
]


@pytest.fixture(autouse=True)
def _function() -> None:
    with connection.cursor() as cur:
        cur.execute(FUNCTION)


@pytest.mark.parametrize("route", ["/callproc", "/copy"])
def test_a_2xx_after_a_write_django_never_saw_commits_and_is_replayed(
    route: str, atomic_requests: bool
) -> None:
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, route, key)
    assert first.status_code == 201, first.content
    assert Payment.objects.count() == 1  # the answer says it was made: it was
    assert stored_keys(key) == 1
    second = post(client, route, key)
    assert second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert json.loads(second.content) == json.loads(first.content)
    assert Payment.objects.count() == 1  # the retry paid nothing more


def test_a_refusal_after_such_a_write_rolls_it_back_and_the_retry_runs(
    atomic_requests: bool,
) -> None:
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        assert post(client, "/refuse-after-callproc", key).status_code == 409
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
