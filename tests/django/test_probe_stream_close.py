"""A streamed body cut at MAX_RESPONSE_BYTES: the view's generator is closed inside the
request's transaction, so what its ``finally`` writes rolls back with the rest instead of
committing on its own once the transaction is over."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpRequest, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"
CHUNK = b"." * 100


def _parts() -> Iterator[bytes]:
    try:
        for _ in range(10):
            yield CHUNK
    finally:
        Payment.objects.create(principal="finally", amount=1, currency="EUR")


async def _async_parts() -> AsyncIterator[bytes]:
    try:
        for _ in range(10):
            yield CHUNK
    finally:
        await sync_to_async(Payment.objects.create)(principal="finally", amount=1, currency="EUR")


def stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(_parts(), status=201)


async def async_stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(_async_parts(), status=201)


urlpatterns = [path("stream", stream), path("async-stream", async_stream)]


def _too_large(answer: Any) -> None:
    assert answer.status_code == 500
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert "Idempotency-Key-Expires" not in answer.headers


def test_a_write_in_the_finally_of_a_cut_stream_rolls_back(
    settings: Any, atomic_requests: bool
) -> None:
    settings.PGONCE = {**settings.PGONCE, "MAX_RESPONSE_BYTES": 250}
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        _too_large(post(client, "/stream", key))
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_write_in_the_finally_of_a_cut_async_stream_rolls_back(settings: Any) -> None:
    settings.PGONCE = {**settings.PGONCE, "MAX_RESPONSE_BYTES": 250}
    client = AsyncClient()
    headers = {"Authorization": ALICE, "Idempotency-Key": uuid.uuid4().hex}
    for _ in range(2):
        answer = async_to_sync(client.post)(
            "/async-stream", b"{}", content_type="application/json", headers=headers
        )
        _too_large(answer)
        assert json.loads(answer.content)["status"] == 500
    assert Payment.objects.count() == 0
    assert stored_keys(headers["Idempotency-Key"]) == 0
