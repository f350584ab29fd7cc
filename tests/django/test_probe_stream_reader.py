"""The streamed-body reader, one for synchronous and async bodies: an iterator that is not a
generator is read, stored and replayed, its ``close()`` called inside the request's transaction
(a write there commits with the stored answer, or rolls back with a body cut at the limit), and
a body whose iterator has no ``close()`` is read as it is."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpRequest, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.streamed import CHUNK, Parts
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"


class AsyncParts:
    """Five chunks, then a payment written by ``aclose()``."""

    def __init__(self) -> None:
        self.left = 5

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if not self.left:
            raise StopAsyncIteration
        self.left -= 1
        return CHUNK

    async def aclose(self) -> None:
        await sync_to_async(Payment.objects.create)(principal="close", amount=1, currency="EUR")


def parts(request: HttpRequest) -> StreamingHttpResponse:
    # Its first close() writes (Django's response calls it again when it is closed).
    return StreamingHttpResponse(Parts(5, write_once=True), status=201)


async def async_parts(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(AsyncParts(), status=201)


def listed(request: HttpRequest) -> StreamingHttpResponse:
    Payment.objects.create(principal="listed", amount=1, currency="EUR")
    return StreamingHttpResponse([b"a", "b", CHUNK], status=201)


urlpatterns = [path("parts", parts), path("async-parts", async_parts), path("listed", listed)]


def _body(answer: Any) -> bytes:
    """The body of the first answer (streamed again) or of a replay (a plain response)."""
    if answer.streaming:
        return b"".join(answer.streaming_content)
    return bytes(answer.content)


def test_an_iterator_closed_at_its_end_commits_its_write_with_the_stored_answer() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first, again = post(client, "/parts", key), post(client, "/parts", key)
    assert (first.status_code, _body(first)) == (201, CHUNK * 5)
    assert (again.status_code, _body(again)) == (201, CHUNK * 5)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert Payment.objects.filter(principal="close").count() == 1
    assert stored_keys(key) == 1


def test_an_iterator_cut_at_the_limit_is_closed_and_its_write_rolled_back(settings: Any) -> None:
    settings.PGONCE = {**settings.PGONCE, "MAX_RESPONSE_BYTES": 250}
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        answer = post(client, "/parts", key)
        assert answer.status_code == 500
        assert answer.headers["Content-Type"] == "application/problem+json"
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


@pytest.mark.parametrize("limit", [1 << 20, 250])
def test_an_async_iterator_is_closed_in_the_transaction(settings: Any, limit: int) -> None:
    settings.PGONCE = {**settings.PGONCE, "MAX_RESPONSE_BYTES": limit}
    client = AsyncClient()
    headers = {"Authorization": ALICE, "Idempotency-Key": uuid.uuid4().hex}
    for _ in range(2):
        answer = async_to_sync(client.post)(
            "/async-parts", b"{}", content_type="application/json", headers=headers
        )
        assert answer.status_code == (201 if limit > 500 else 500)
    assert Payment.objects.count() == (1 if limit > 500 else 0)
    assert stored_keys(headers["Idempotency-Key"]) == (1 if limit > 500 else 0)


def test_a_listed_body_without_close_is_stored_and_replayed() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first, again = post(client, "/listed", key), post(client, "/listed", key)
    assert _body(first) == _body(again) == b"ab" + CHUNK
    assert again.headers["Idempotent-Replayed"] == "true"
    assert Payment.objects.count() == 1
