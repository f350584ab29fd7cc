"""The receiver given a pool (or a schema) it cannot use refuses it at set-up, naming it. A sync
``ConnectionPool`` was taken, and every delivery was then answered 503 "retry later" for ever,
logged as a storage failure, until the provider gave up on the events."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pgonce.errors import UsageError
from pgonce.webhooks.receiver import InboxReceiver
from tests.inbox.conftest import source


class AsyncDefPool:
    async def connection(self) -> Any:
        raise AssertionError("not called at set-up")


@pytest.mark.parametrize("kind", ["sync-pool", "no-connection", "async-def"])
def test_a_pool_the_receiver_cannot_use_is_refused(server_dsn: str, kind: str) -> None:
    pool: Any = {
        "sync-pool": ConnectionPool(server_dsn, open=False),
        "no-connection": server_dsn,
        "async-def": AsyncDefPool(),
    }[kind]
    with pytest.raises(UsageError, match=r"pool must be a psycopg_pool\.AsyncConnectionPool"):
        InboxReceiver([source()], pool=pool)


def test_an_async_pool_is_taken(server_dsn: str) -> None:
    pool = AsyncConnectionPool(server_dsn, open=False)
    assert InboxReceiver([source()], pool=pool).pool is pool


@pytest.mark.parametrize(
    ("schema", "named"),
    [(None, "must be a str"), ("Inbox", "is not allowed"), ("pg_inbox", "PostgreSQL's own")],
)
def test_a_schema_pgonce_cannot_have_is_refused(schema: object, named: str) -> None:
    # It was taken, and every delivery was answered 503 "retry later" for ever: the schema is
    # not migrated, and `pgonce migrate` refuses the name.
    with pytest.raises(UsageError, match=named):
        InboxReceiver([source()], dsn="postgresql://db/app", schema=schema)  # type: ignore[arg-type]
