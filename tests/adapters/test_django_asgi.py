"""Django under uvicorn: an async view writing with the async ORM joins the claim's transaction.

The view's ``acreate()`` runs through ``sync_to_async`` and lands on the thread in which the
middleware holds the transaction, so the payment commits with the key (or not at all).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.adapters.conftest import ADAPTERS, Adapter
from tests.http.conftest import Server
from tests.http.test_http_middleware import keys, new_key, payments, post


@pytest.fixture
def adapter() -> Adapter:
    return ADAPTERS["django-asgi"]


def test_an_async_view_pays_once_and_replays(server: Server, db: psycopg.Connection[Any]) -> None:
    key = new_key()
    first = post(server, "/async/payments", key)
    second = post(server, "/async/payments", key)
    assert first.status_code == second.status_code == 201, first.text
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert payments(db) == 1
    assert keys(db) == 1


def test_an_async_view_refused_before_any_query_is_not_stored(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = new_key()
    invalid = post(server, "/async/payments", key, body={"amount": 0, "currency": "EUR"})
    assert invalid.status_code == 422
    assert keys(db) == 0
    assert post(server, "/async/payments", key).status_code == 201
    assert payments(db) == 1
