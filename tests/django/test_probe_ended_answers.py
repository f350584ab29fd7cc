"""What the "Transaction ended by the endpoint" problem tells the client of a Django view that
ended the request's transaction itself and wrote on, and what a retry with the same key then
gets. Rolled back: nothing committed, and the retry runs the view again. Committed: the write
before the end committed with the claim, unanswered, so the retry is answered 409 (in
progress), and the first write is never made again."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from pgonce.http import semantics
from tests.django.test_django import post, stored_keys
from tests.django.test_probe_atomic_ended import end_then_write

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

urlpatterns = [path("end-then-write", end_then_write)]


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def atomic_requests(request: pytest.FixtureRequest) -> Iterator[bool]:
    previous = connection.settings_dict["ATOMIC_REQUESTS"]
    connection.settings_dict["ATOMIC_REQUESTS"] = request.param
    yield request.param
    connection.settings_dict["ATOMIC_REQUESTS"] = previous


def payments(principal: str) -> int:
    count: int = Payment.objects.filter(principal=principal).count()
    return count


@pytest.mark.parametrize("how", ["ROLLBACK", "rollback"])
def test_a_rollback_then_writes_is_told_that_the_retry_runs_again(
    how: str, atomic_requests: bool
) -> None:
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    first = post(client, f"/end-then-write?how={how}", key)
    assert first.status_code == 500
    assert (
        json.loads(first.content)["detail"]
        == json.loads(semantics.TRANSACTION_ENDED.body)["detail"]
    )
    assert (payments("before"), payments("after"), stored_keys(key)) == (0, 0, 0)
    again = post(client, f"/end-then-write?how={how}", key)
    assert again.status_code == 500  # ran again, and ended its transaction again
    assert (payments("before"), payments("after"), stored_keys(key)) == (0, 0, 0)


@pytest.mark.parametrize("how", ["COMMIT", "commit"])
def test_a_commit_then_writes_leaves_the_key_in_flight(how: str, atomic_requests: bool) -> None:
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    first = post(client, f"/end-then-write?how={how}", key)
    assert first.status_code == 500
    assert json.loads(first.content)["title"] == "Transaction ended by the endpoint"
    assert (payments("before"), payments("after"), stored_keys(key)) == (1, 0, 1)
    again = post(client, f"/end-then-write?how={how}", key)
    assert again.status_code == 409
    assert json.loads(again.content)["title"] == "Request in progress"
    assert (payments("before"), payments("after"), stored_keys(key)) == (1, 0, 1)


@pytest.mark.parametrize("how", ["COMMIT", "commit"])
def test_a_commit_then_writes_is_told_that_the_writes_before_it_committed(
    how: str, atomic_requests: bool
) -> None:
    client = Client(raise_request_exception=False)
    first = post(client, f"/end-then-write?how={how}", uuid.uuid4().hex)
    assert json.loads(first.content) == json.loads(semantics.TRANSACTION_ENDED_COMMITTED.body)
