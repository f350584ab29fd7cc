"""The library's sweeper on a node that takes no writes (a standby, a read-only default): one
failure, raised at the first target, with no warning for each of the others, which the same node
refuses alike. A table locked or a batch that timed out is one target's failure, and the others
are still swept (tests/test_sweeper.py)."""

from __future__ import annotations

import logging

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgonce import Sweeper
from pgonce.errors import DatabaseUnavailable
from pgonce.store._async.sweeper import AsyncSweeper


def _read_only(dsn: str) -> str:
    return make_conninfo(dsn, options="-c default_transaction_read_only=on")


def test_a_read_only_node_fails_the_run_once(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce")
    with (
        psycopg.connect(_read_only(direct_dsn), autocommit=True) as conn,
        pytest.raises(DatabaseUnavailable, match="takes no writes") as raised,
    ):
        Sweeper().sweep(conn)
    assert "read-only" in str(raised.value) or "read only" in str(raised.value)
    assert [r.getMessage() for r in caplog.records] == []


async def test_async_a_read_only_node_fails_the_run_once(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce")
    async with await psycopg.AsyncConnection.connect(
        _read_only(direct_dsn), autocommit=True
    ) as conn:
        with pytest.raises(DatabaseUnavailable, match="takes no writes"):
            await AsyncSweeper().sweep(conn)
    assert [r.getMessage() for r in caplog.records] == []
