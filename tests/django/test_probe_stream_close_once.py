"""A streamed body whose iterator's ``close()`` writes (not a generator: each call writes).

The middleware reads the body inside the request's transaction and closes the iterator there, so
that what ``close()`` writes commits with the stored answer or rolls back with a cut body. Django
had registered the same ``close()`` among the response's closers, and called it again when the
server closed the response, after the commit: a second write, committed on its own, that no
replay makes and no retry undoes. The middleware now takes it off the list once it has run it.
"""

from __future__ import annotations

import uuid

import pytest
from django.http import HttpRequest, StreamingHttpResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.streamed import CHUNK, Parts
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


def parts(request: HttpRequest) -> StreamingHttpResponse:
    # Every close() writes: a second call would show as a second payment.
    return StreamingHttpResponse(Parts(3), status=201)


urlpatterns = [path("parts", parts)]


def test_the_iterators_close_runs_once_inside_the_transaction() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, "/parts", key)
    assert first.status_code == 201
    assert b"".join(first.streaming_content) == CHUNK * 3
    first.close()  # what the server does once the body is sent
    assert Payment.objects.filter(principal="close").count() == 1
    assert stored_keys(key) == 1
