"""With Django's default CONN_MAX_AGE = 0 every request opens a connection: the pooler check
(``SHOW port``, POOLER "auto") is asked once per server address, not once per connection."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import close_old_connections, connection
from django.db.backends.signals import connection_created
from django.test import Client

from pgonce import database
from tests.django.test_django import post

pytestmark = pytest.mark.django_db(transaction=True)

REQUESTS = 5


@pytest.fixture
def shown_ports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The backend pid of each ``SHOW port`` that psycopg sends to the server, in this test, on
    an empty record of answers (an earlier test may have asked this address already)."""
    monkeypatch.setattr(database, "_PORT_SHOWN", {})
    monkeypatch.delenv("PGONCE_POOLER", raising=False)
    sent: list[int] = []
    execute = psycopg.Cursor.execute

    def counting(cur: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "SHOW port":
            sent.append(cur.connection.info.backend_pid)
        return execute(cur, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counting)
    return sent


@pytest.fixture
def opened() -> Iterator[list[int]]:
    """The backend pid of each connection Django opens in the test."""
    pids: list[int] = []

    def record(sender: Any, connection: Any, **kwargs: Any) -> None:
        pids.append(connection.connection.info.backend_pid)

    connection_created.connect(record)
    yield pids
    connection_created.disconnect(record)


def test_with_conn_max_age_0_the_pooler_check_is_sent_once_for_all_requests(
    shown_ports: list[int], opened: list[int]
) -> None:
    assert connection.settings_dict["CONN_MAX_AGE"] == 0
    connection.close()
    client = Client()
    for _ in range(REQUESTS):
        assert post(client, "/payments", str(uuid.uuid4())).status_code == 201
        # What Django's handler does at request_finished, which its test client leaves out.
        close_old_connections()
    assert len(set(opened)) == REQUESTS  # a connection of its own for each request
    assert len(shown_ports) == 1
    assert shown_ports[0] == opened[0]  # the first connection asked, the next ones did not
