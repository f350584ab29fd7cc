"""Streamed bodies whose generator tries to end the request's transaction: a durable block or
connection.commit() while the middleware reads the body, plain and under ATOMIC_REQUESTS, and an
async generator under Django's ASGI handler."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection, transaction
from django.http import HttpRequest, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"


def _durable() -> Iterator[bytes]:
    yield b"["
    with transaction.atomic(durable=True):
        Payment.objects.create(principal="t", amount=1, currency="EUR")
    yield b"]"


def _commit() -> Iterator[bytes]:
    Payment.objects.create(principal="t", amount=1, currency="EUR")
    yield b"["
    connection.commit()
    yield b"]"


async def _durable_async() -> AsyncIterator[bytes]:
    yield b"["
    await sync_to_async(_durable_payment)()
    yield b"]"


def _durable_payment() -> None:
    with transaction.atomic(durable=True):
        Payment.objects.create(principal="t", amount=1, currency="EUR")


async def durable_async_stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(_durable_async(), status=201)


def durable_stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(_durable(), status=201)


def commit_stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(_commit(), status=201)


urlpatterns = [
    path("durable-stream", durable_stream),
    path("commit-stream", commit_stream),
    path("durable-async-stream", durable_async_stream),
]


@pytest.mark.parametrize("route", ["/durable-stream", "/commit-stream"])
def test_a_streamed_body_that_ends_the_transaction_is_a_problem_answer(
    route: str, atomic_requests: bool, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        for _ in range(2):
            refused = post(client, route, key)
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert "UsageError" in caplog.text
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_an_async_streamed_body_with_a_durable_block_is_a_problem_answer() -> None:
    client = AsyncClient(raise_request_exception=False)
    headers = {"Authorization": ALICE, "Idempotency-Key": uuid.uuid4().hex}
    for _ in range(2):
        refused = async_to_sync(client.post)(
            "/durable-async-stream", b"{}", content_type="application/json", headers=headers
        )
        assert refused.status_code == 500
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert Payment.objects.count() == 0
    assert stored_keys(headers["Idempotency-Key"]) == 0
