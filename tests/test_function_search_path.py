"""pgonce's functions read and write pgonce's tables, whatever temporary tables the caller's
connection holds.

PostgreSQL searches the session's temporary schema (pg_temp) for tables and types before every
schema of search_path, unless search_path names pg_temp itself. A function pinned to pgonce's
schema alone (``SET search_path FROM CURRENT`` under the migration runner's ``search_path =
pgonce``) therefore used a caller's temporary ``keys``, ``inbox`` or ``outbox`` table instead of
pgonce's: a claim that pgonce never stored, answered as won to every caller. Every function of the
schema now names pg_temp last (0020), as PostgreSQL's documentation recommends for functions that
set their search_path.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import KeyStore, Won, fingerprint
from pgonce.core.inbox import Delivery, digest
from pgonce.store._sync.inbox import InboxStore
from pgonce.store.migrate import migrate

SCHEMA = "pgonce"
FP = fingerprint("POST", "/orders", b'{"amount": 42}')

FUNCTION_PATHS = """
    SELECT p.oid::regprocedure::text, c.setting
      FROM pg_proc p
      JOIN pg_namespace n ON n.oid = p.pronamespace
      LEFT JOIN LATERAL unnest(p.proconfig) AS c(setting) ON c.setting LIKE 'search_path=%%'
     WHERE n.nspname = %s
     ORDER BY 1"""


def shadow(conn: psycopg.Connection[Any], table: str) -> None:
    """A temporary table of the caller's with the name and the shape of one of pgonce's."""
    conn.execute(f"CREATE TEMP TABLE {table} (LIKE {SCHEMA}.{table} INCLUDING ALL)")
    conn.commit()


def count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else -1


def test_a_claim_is_stored_in_pgonces_keys_not_in_a_temporary_table_of_that_name(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    store = KeyStore(schema=SCHEMA)
    shadow(conn, "keys")
    assert isinstance(store.claim(conn, "tenant-a", "k1", FP), Won)
    conn.commit()
    assert count(conn, f"{SCHEMA}.keys") == 1
    assert count(conn, "pg_temp.keys") == 0
    # Another connection sees the committed claim: the key is not won twice.
    with psycopg.connect(dsn) as other:
        assert not isinstance(store.claim(other, "tenant-a", "k1", FP), Won)
        other.rollback()


def test_the_inbox_stores_in_pgonces_inbox_not_in_a_temporary_table_of_that_name(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    store = InboxStore(schema=SCHEMA)
    body = b'{"id": "evt_1"}'
    event = Delivery("shop", "evt_1", body, {"x-signature": "s"}, digest(body))
    shadow(conn, "inbox")
    with conn.transaction():
        assert store.store(conn, [event]) == ["stored"]
    assert count(conn, f"{SCHEMA}.inbox") == 1
    assert count(conn, "pg_temp.inbox") == 0
    with psycopg.connect(dsn) as other, other.transaction():
        assert store.store(other, [event]) == ["duplicate"]


def test_outbox_enqueue_writes_pgonces_outbox_not_a_temporary_table_of_that_name(
    conn: psycopg.Connection[Any],
) -> None:
    # outbox_enqueue() is kept for callers of pgonce before 0014; enqueue() runs its own statement.
    shadow(conn, "outbox")
    shadow(conn, "outbox_aggregates")
    conn.execute(
        f"SELECT {SCHEMA}.outbox_enqueue('order', '1', 'created', '{{}}', '{{}}', NULL, 'x')"
    )
    conn.commit()
    assert count(conn, f"{SCHEMA}.outbox") == 1
    assert count(conn, f"{SCHEMA}.outbox_aggregates") == 1
    assert count(conn, "pg_temp.outbox") == 0
    assert count(conn, "pg_temp.outbox_aggregates") == 0


def test_every_function_searches_its_schema_then_pg_temp(conn: psycopg.Connection[Any]) -> None:
    paths: dict[str, str] = dict(conn.execute(FUNCTION_PATHS, (SCHEMA,)).fetchall())
    assert {"pgonce.claim", "pgonce.inbox_store", "pgonce.outbox_enqueue"} <= {
        name.split("(")[0] for name in paths
    }
    wrong = {name: path for name, path in paths.items() if path != "search_path=pgonce, pg_temp"}
    assert not wrong


@pytest.mark.parametrize("schema", ["tenant_idem", "select"])
def test_a_configured_schema_is_the_one_its_functions_search(empty_dsn: str, schema: str) -> None:
    """The schema's name is configurable: 0020 takes it from the migration, never as "pgonce"
    (a reserved word works too)."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, schema)
        paths: dict[str, str] = dict(conn.execute(FUNCTION_PATHS, (schema,)).fetchall())
    assert len(paths) >= 3
    assert set(paths.values()) == {f"search_path={schema}, pg_temp"}


def test_a_temporary_table_of_the_migrating_connection_is_left_alone(empty_dsn: str) -> None:
    """The migrations' own unqualified names reach pgonce's tables, not a temporary table of the
    connection that runs `pgonce migrate` (each migration runs with pg_temp last)."""
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("CREATE TEMP TABLE keys (scope text, key text)")
        conn.execute("INSERT INTO keys VALUES ('mine', 'untouched')")
        conn.commit()
        migrate(conn, SCHEMA)
        assert conn.execute("SELECT scope, key FROM pg_temp.keys").fetchall() == [
            ("mine", "untouched")
        ]
        temp_columns = conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'pg_temp.keys'::regclass"
            " AND attnum > 0 AND NOT attisdropped"
        ).fetchone()
        assert temp_columns == (2,)
        assert conn.execute(FUNCTION_PATHS, (SCHEMA,)).fetchall()
        assert conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND tablename = 'keys'",
            (SCHEMA,),
        ).fetchone() != (0,)
