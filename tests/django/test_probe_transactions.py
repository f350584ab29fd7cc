"""How the Idempotency-Key middleware meets a view's own transaction handling: on_commit hooks,
durable and savepoint-less atomic() blocks, a constraint that fails only at COMMIT, methods the
middleware does not cover. Both ways Django runs views: plain, and under ATOMIC_REQUESTS."""

from __future__ import annotations

import json
import logging
import uuid

import pytest
from django.db import IntegrityError, connection
from django.test import Client

from examples.django_payments.payments.models import Payment, Refund
from tests.django.test_django import post

pytestmark = pytest.mark.django_db(transaction=True)

ALICE = {"HTTP_AUTHORIZATION": "Bearer alice-token"}


def new_key() -> str:
    return str(uuid.uuid4())


def stored_keys(key: str) -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pgonce.keys WHERE key = %s", (key,))
        row = cur.fetchone()
    assert row is not None
    return int(row[0])


def test_an_on_commit_hook_of_a_view_without_a_query_runs_once_with_the_stored_answer(
    client: Client, atomic_requests: bool
) -> None:
    # A view whose one effect is an on_commit hook (an e-mail, a task) ran no query: its hook
    # was dropped with the rolled-back transaction while the client was told 201, and every
    # retry ran the view again, dropping the hook again.
    from tests.django.views import HOOKED as hooked

    hooked.clear()
    key = new_key()
    first = post(client, "/hook-without-query", key)
    assert first.status_code == 201
    assert hooked == [first.json()["nonce"]]
    assert stored_keys(key) == 1
    again = post(client, "/hook-without-query", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert hooked == [first.json()["nonce"]]  # the replay runs no view and no hook


def test_a_durable_block_in_a_view_is_a_problem_answer_not_a_500_page(
    atomic_requests: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Django refuses atomic(durable=True) inside the request's transaction with a RuntimeError,
    # which became its HTML 500 page.
    client = Client(raise_request_exception=False)
    key = new_key()
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        for _ in range(2):  # the key stays free: the retry runs the view, refused again
            refused = post(client, "/durable-block", key)
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert "durable=True" in caplog.text
    assert "UsageError" in caplog.text
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_deferred_constraint_that_fails_at_commit_raises_djangos_integrity_error(
    client: Client, atomic_requests: bool
) -> None:
    # Django's foreign keys are deferred: a broken reference fails at the COMMIT that pgonce
    # sends with the completion. The view's code and Django's handlers see what Django itself
    # raises from its COMMIT, django.db.IntegrityError, not psycopg's ForeignKeyViolation.
    key = new_key()
    for _ in range(2):  # nothing committed, the key is free: the retry fails the same way
        with pytest.raises(IntegrityError, match="refunds"):
            post(client, "/broken-reference", key)
    assert Payment.objects.count() == 0
    assert Refund.objects.count() == 0
    assert stored_keys(key) == 0


def test_an_error_in_a_block_without_a_savepoint_rolls_the_request_back(
    client: Client, atomic_requests: bool
) -> None:
    # atomic(savepoint=False) cannot undo its part: the error marks the request's transaction
    # for rollback, so the view's earlier write and its answer are not kept.
    key = new_key()
    for _ in range(2):
        answered = post(client, "/no-savepoint-caught", key)
        assert answered.status_code == 409
        assert "Idempotent-Replayed" not in answered.headers
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


@pytest.mark.parametrize("method", ["head", "options", "get", "put", "delete"])
def test_a_method_not_covered_passes_through_unclaimed(client: Client, method: str) -> None:
    key = new_key()
    answered = getattr(client, method)("/payments", HTTP_IDEMPOTENCY_KEY=key, **ALICE)
    assert answered.status_code == 405  # the view's own answer
    assert "Idempotency-Key-Expires" not in answered.headers
    assert stored_keys(key) == 0
