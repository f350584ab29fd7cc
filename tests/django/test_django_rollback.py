"""A view whose transaction is marked for rollback (``transaction.set_rollback(True)``) while it
answers: its writes never commit, so neither may its answer. Nothing is stored and the key stays
free, whether the mark is on ATOMIC_REQUESTS' block, the view's own outermost ``atomic()`` block
or the middleware's block. A part the view undoes inside its transaction (a nested block marked
for rollback, a block an exception it caught rolled back) is stored with the rest."""

from __future__ import annotations

import json
import logging

import pytest
from django.db import connection
from django.test import Client

from examples.django_payments.payments.models import Payment
from tests.django.test_django import new_key, post, stored_keys

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("path", ["/mark-for-rollback", "/mark-own-block-for-rollback"])
def test_a_view_that_marks_its_transaction_for_rollback_is_not_stored(
    client: Client, atomic_requests: bool, path: str
) -> None:
    if atomic_requests and path == "/mark-own-block-for-rollback":
        pytest.skip("a nested block then: a part the view undoes (below)")
    key = new_key()
    first = post(client, path, key)
    second = post(client, path, key)
    assert first.status_code == second.status_code == 200
    assert json.loads(first.content) == {"saved": False}
    assert "Idempotency-Key-Expires" not in first.headers
    assert "Idempotent-Replayed" not in second.headers  # ran again: the key was free
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_part_the_view_undoes_inside_its_transaction_keeps_the_answer_stored(
    client: Client, atomic_requests: bool
) -> None:
    key = new_key()
    first = post(client, "/undo-a-part-then-write", key)
    second = post(client, "/undo-a-part-then-write", key)
    assert first.status_code == second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1


def test_a_nested_block_marked_for_rollback_under_atomic_requests_is_a_part_undone(
    client: Client,
) -> None:
    # Under ATOMIC_REQUESTS the view's own block is nested in the request's, which commits: so
    # Django commits it without the middleware, and the answer is stored with it.
    previous = connection.settings_dict["ATOMIC_REQUESTS"]
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        key = new_key()
        first = post(client, "/mark-own-block-for-rollback", key)
        second = post(client, "/mark-own-block-for-rollback", key)
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = previous
    assert first.status_code == second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 1


@pytest.mark.parametrize("how", ["commit", "autocommit-off"])
def test_a_view_that_commits_the_request_is_refused_with_a_problem_and_nothing_done(
    client: Client, atomic_requests: bool, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Django refuses it inside the middleware's atomic() block; the middleware answers what was
    # wrong (never Django's 500 page), rolls the claim back with the write, and the retry runs.
    key = new_key()
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        for _ in range(2):
            refused = post(client, f"/commit-the-request?how={how}", key)
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
            assert "Idempotency-Key-Expires" not in refused.headers
    logged = [r for r in caplog.records if r.name == "pgonce.http"]
    assert len(logged) == 2
    assert all("UsageError: " in r.getMessage() and r.exc_info is None for r in logged)
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


@pytest.mark.parametrize("action", ["rollback", "commit"])
def test_a_view_that_ends_the_transaction_on_psycopg_never_leaves_the_key_in_flight(
    client: Client, action: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Rolled back: nothing committed, so the client gets the problem and the retry runs.
    # Committed: the claim committed with the write before its answer was stored; the answer is
    # stored after it, never a key in flight until it expires (nor a 500 traceback).
    key = new_key()
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        first = post(client, f"/end-on-psycopg?action={action}", key)
        second = post(client, f"/end-on-psycopg?action={action}", key)
    logged = [r.getMessage() for r in caplog.records if r.name == "pgonce.http"]
    assert all("UsageError: " in message for message in logged)
    if action == "rollback":
        for answer in (first, second):  # the second ran again: the key was free
            assert answer.status_code == 500
            assert answer.headers["Content-Type"] == "application/problem+json"
        assert (Payment.objects.count(), stored_keys(key), len(logged)) == (0, 0, 2)
    else:
        assert first.status_code == second.status_code == 201
        assert "Idempotency-Key-Expires" in first.headers
        assert second.headers["Idempotent-Replayed"] == "true"
        assert second.content == first.content
        assert (Payment.objects.count(), stored_keys(key), len(logged)) == (1, 1, 1)
