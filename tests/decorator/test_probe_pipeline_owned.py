"""A function decorated with ``commit=True`` called on an autocommit connection inside psycopg's
pipeline: refused (its transaction cannot begin there), and the refusal names the pipeline; it
spoke only of a caller's transaction, which the connection does not have."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent


def test_commit_true_in_a_pipeline_names_the_pipeline(dsn: str) -> None:
    @idempotent(key="order", scope="piped-owned", commit=True)
    def ship(conn: psycopg.Connection[Any], order: str) -> str:
        return order

    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.pipeline(), pytest.raises(UsageError, match=r"outside conn\.pipeline\(\)"):
            ship(conn, "o-1")
        assert ship(conn, "o-1") == "o-1"  # out of the pipeline, as it says
