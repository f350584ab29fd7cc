"""Async views' on_commit hooks and durable blocks under Django's ASGI handler, a FileResponse
with an outbox event, and a persistent connection the server closed between two requests."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection, transaction
from django.http import FileResponse, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.outbox import enqueue
from tests.django.test_django import post, scalar, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"

#: What the on_commit hooks of ``hook_async`` ran for, in order.
hooked: list[str] = []


async def hook_async(request: HttpRequest) -> HttpResponse:
    # Its one effect is an on_commit hook, registered from the async view: no query.
    nonce = uuid.uuid4().hex
    await sync_to_async(transaction.on_commit)(lambda: hooked.append(nonce))
    return JsonResponse({"nonce": nonce}, status=201)


def _durable_payment() -> int:
    with transaction.atomic(durable=True):
        return int(Payment.objects.create(principal="t", amount=1, currency="EUR").pk)


async def durable_async(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"id": await sync_to_async(_durable_payment)()}, status=201)


def file_with_event(request: HttpRequest) -> HttpResponseBase:
    payment = Payment.objects.create(principal="t", amount=1, currency="EUR")
    enqueue("payment", str(payment.pk), "payment.created", {"amount": 1})
    return FileResponse(io.BytesIO(f"{payment.pk};".encode() * 100), status=201)


def plain(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.create(principal="t", amount=1, currency="EUR")
    return JsonResponse({"id": payment.pk}, status=201)


urlpatterns = [
    path("hook-async", hook_async),
    path("durable-async", durable_async),
    path("file", file_with_event),
    path("plain", plain),
]


def apost(path: str, key: str) -> Any:
    client = AsyncClient(raise_request_exception=False)
    headers = {"Authorization": ALICE, "Idempotency-Key": key}
    return async_to_sync(client.post)(path, b"{}", content_type="application/json", headers=headers)


def test_an_async_views_on_commit_hook_runs_once_with_the_stored_answer() -> None:
    hooked.clear()
    key = uuid.uuid4().hex
    first = apost("/hook-async", key)
    assert first.status_code == 201
    nonce = json.loads(first.content)["nonce"]
    assert hooked == [nonce]
    again = apost("/hook-async", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert hooked == [nonce]  # the replay runs no view and no hook
    assert stored_keys(key) == 1


def test_a_durable_block_in_an_async_view_is_a_problem_answer() -> None:
    key = uuid.uuid4().hex
    refused = apost("/durable-async", key)
    assert refused.status_code == 500
    assert refused.headers["Content-Type"] == "application/problem+json"
    assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_file_response_is_stored_and_replayed_with_one_payment_and_one_event(
    client: Client,
) -> None:
    key = uuid.uuid4().hex
    first = post(client, "/file", key)
    body = b"".join(first.streaming_content)
    again = post(client, "/file", key)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == body
    payment = str(Payment.objects.get().pk)  # one payment
    assert body == f"{payment};".encode() * 100
    # One event (the outbox outlives pytest-django's flush: counted by its aggregate).
    assert scalar("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s", payment) == 1


def test_a_claim_on_a_connection_the_server_closed_is_503_and_the_retry_runs() -> None:
    # A persistent connection (CONN_MAX_AGE=None) the server ended between two requests (a
    # restart, a failover): the claim meets the loss, 503 with Retry-After, nothing kept.
    kept = connection.settings_dict["CONN_MAX_AGE"]
    connection.settings_dict["CONN_MAX_AGE"] = None
    try:
        client = Client(raise_request_exception=False)
        assert post(client, "/plain", uuid.uuid4().hex).status_code == 201
        with psycopg.connect(connection.connection.info.dsn, autocommit=True) as other:
            pid = connection.connection.info.backend_pid
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        key = uuid.uuid4().hex
        lost = post(client, "/plain", key)
        assert lost.status_code == 503
        assert lost.headers["Content-Type"] == "application/problem+json"
        assert int(lost.headers["Retry-After"]) >= 0
        connection.close_if_unusable_or_obsolete()  # a server's request_finished does this
        retried = post(client, "/plain", key)
        assert retried.status_code == 201
        assert "Idempotent-Replayed" not in retried.headers
    finally:
        connection.settings_dict["CONN_MAX_AGE"] = kept
        connection.close()
    assert Payment.objects.count() == 2
    assert stored_keys(key) == 1
