"""The fixtures give every test a database of its own, already migrated."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest


@pytest.mark.parametrize("run", range(4))
def test_each_test_sees_only_its_own_rows(conn: psycopg.Connection[Any], run: int) -> None:
    # If two of these four runs shared a database, the second would find the first's row.
    conn.execute("CREATE TABLE IF NOT EXISTS marks (run int)")
    conn.execute("INSERT INTO marks VALUES (%s)", (run,))
    assert conn.execute("SELECT array_agg(run) FROM marks").fetchone() == ([run],)


def test_database_is_migrated(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute("SELECT to_regclass('pgonce.keys') IS NOT NULL").fetchone()
    assert row == (True,)
