"""Async views under Django's ASGI handler (its AsyncClient), and views whose only write is not
an ORM query: each commits with the claim exactly once, or not at all.

Tests are ``transaction=True``: each commits for real, and rows are counted in the database.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.outbox import enqueue
from tests.django.test_django import scalar, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"


def _payment() -> int:
    return int(Payment.objects.create(principal="test", amount=1, currency="EUR").pk)


async def stream_async(request: HttpRequest) -> HttpResponse:
    async def parts() -> AsyncIterator[bytes]:
        payment = await Payment.objects.acreate(principal="test", amount=1, currency="EUR")
        yield f"{payment.pk}".encode()
        yield b":done"

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


async def stream_async_raises(request: HttpRequest) -> HttpResponse:
    async def parts() -> AsyncIterator[bytes]:
        await Payment.objects.acreate(principal="test", amount=1, currency="EUR")
        yield b"partial"
        raise RuntimeError("the body failed after its write")

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


async def gather_writes(request: HttpRequest) -> HttpResponse:
    first, second = await asyncio.gather(sync_to_async(_payment)(), sync_to_async(_payment)())
    return JsonResponse({"ids": [first, second]}, status=201)


async def raise_after_acreate(request: HttpRequest) -> HttpResponse:
    await Payment.objects.acreate(principal="test", amount=1, currency="EUR")
    raise RuntimeError("the view failed after its write")


def _event() -> int:
    return enqueue("payment", "1", "payment.requested", {"amount": 1})


def only_event(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"event": _event()}, status=202)


async def only_event_async(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"event": await sync_to_async(_event)()}, status=202)


urlpatterns = [
    path("stream-async", stream_async),
    path("stream-async-raises", stream_async_raises),
    path("gather", gather_writes),
    path("raise-after-acreate", raise_after_acreate),
    path("only-event", only_event),
    path("only-event-async", only_event_async),
]


def events() -> int:
    return int(scalar("SELECT count(*) FROM pgonce.outbox"))


def apost(route: str, key: str) -> Any:
    """The request through Django's ASGI handler, so the middleware and the view are async."""

    async def send() -> Any:
        return await AsyncClient(raise_request_exception=False).post(
            route,
            json.dumps({}),
            content_type="application/json",
            headers={"Authorization": ALICE, "Idempotency-Key": key},
        )

    return async_to_sync(send)()


def post(route: str, key: str) -> Any:
    return Client().post(
        route,
        json.dumps({}),
        content_type="application/json",
        headers={"Authorization": ALICE, "Idempotency-Key": key},
    )


def body(response: Any) -> bytes:
    if response.streaming:

        async def read() -> bytes:
            return b"".join([bytes(chunk) async for chunk in response])

        return async_to_sync(read)()
    return bytes(response.content)


@pytest.mark.parametrize("send", [apost, post], ids=["asgi", "wsgi"])
def test_an_async_streamed_body_writes_in_the_claims_transaction_and_replays(send: Any) -> None:
    key = str(uuid.uuid4())
    first = send("/stream-async", key)
    assert first.status_code == 201
    content = body(first)
    second = send("/stream-async", key)
    assert second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert body(second) == content == f"{Payment.objects.get().pk}:done".encode()
    assert stored_keys(key) == 1


def test_an_async_streamed_body_that_raises_after_its_write_rolls_it_back() -> None:
    key = str(uuid.uuid4())
    assert apost("/stream-async-raises", key).status_code == 500
    assert (Payment.objects.count(), stored_keys(key)) == (0, 0)


def test_gathered_orm_calls_of_an_async_view_commit_once_with_the_claim() -> None:
    key = str(uuid.uuid4())
    first, second = apost("/gather", key), apost("/gather", key)
    assert first.status_code == second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert Payment.objects.count() == 2
    assert stored_keys(key) == 1


def test_an_async_view_that_raises_after_acreate_rolls_back_and_frees_the_key() -> None:
    key = str(uuid.uuid4())
    assert apost("/raise-after-acreate", key).status_code == 500
    assert apost("/raise-after-acreate", key).status_code == 500
    assert (Payment.objects.count(), stored_keys(key)) == (0, 0)


@pytest.mark.parametrize(("route", "send"), [("/only-event", post), ("/only-event-async", apost)])
def test_a_view_whose_only_write_is_an_outbox_event_commits_it_once_and_replays(
    route: str, send: Any
) -> None:
    # enqueue() writes on the psycopg connection itself, never through Django's cursor.
    before = events()
    key = str(uuid.uuid4())
    first = send(route, key)
    assert first.status_code == 202
    assert events() == before + 1
    second = send(route, key)
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert events() == before + 1
    assert stored_keys(key) == 1
