"""The schema and the runtime statements hold to what a distributed PostgreSQL (Citus) needs.

The design is docs/concepts/beyond-one-primary.md; the table -> distribution column mapping is
pgonce.sql.distribution. Checked here, on the database the migrations build (the catalog, not the
file's text) and on the statement files:

- every table is declared (distributed by a column, or a reference table);
- every unique key of a distributed table contains its distribution column, which is NOT NULL;
- tables that one of pgonce's transactions writes together can be co-located (same type and
  collation of the distribution column: Citus co-locates nothing else);
- no runtime statement takes an advisory lock or leaves session state behind (a setting, a LISTEN,
  a prepared statement, a temporary table, a held cursor);
- ctid only ever narrows a statement that names its rows by key as well, or is a twin of one that
  does not use it: correctness never depends on a row's physical address.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgonce import sql as pgsql
from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.outcomes import Response, Won
from pgonce.sql.distribution import DISTRIBUTION, WRITTEN_TOGETHER
from pgonce.store._sync.keys import KeyStore
from pgonce.store.common import complete_claimed

#: The statement files whose statements run while the application runs (migrate.sql runs only in
#: `pgonce migrate`; it may hold a transaction-scoped advisory lock, and does, to serialize
#: concurrent migrations).
MIGRATION_FILES = {"migrate"}
#: Statements that return a row's ctid without relying on it: claim_insert hands it to commit(),
#: whose completion still names the row by scope and key (test below).
RETURNS_CTID = {("keys", "claim_insert")}

UNIQUE_KEYS = """
    SELECT c.relname, i.relname,
           array(SELECT a.attname FROM unnest(x.indkey) AS k(n)
                   JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.n)
      FROM pg_index x
      JOIN pg_class c ON c.oid = x.indrelid
      JOIN pg_class i ON i.oid = x.indexrelid
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = %s AND (x.indisunique OR x.indisexclusion)
     ORDER BY 1, 2"""

COLUMN = """
    SELECT a.atttypid::regtype::text, a.attcollation::regcollation::text, a.attnotnull
      FROM pg_attribute a
      JOIN pg_class c ON c.oid = a.attrelid
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = %s AND c.relname = %s AND a.attname = %s AND NOT a.attisdropped"""


def _statements() -> dict[tuple[str, str], str]:
    """Every named statement of queries/*.sql, its comments removed: {(file, name): text}."""
    found: dict[tuple[str, str], str] = {}
    for entry in resources.files(pgsql).joinpath("queries").iterdir():
        if entry.name.endswith(".sql"):
            group = entry.name.removesuffix(".sql")
            for name, text in pgsql.parse_named(entry.read_text(encoding="utf-8")).items():
                found[(group, name)] = _code(text)
    return found


def _code(text: str) -> str:
    """SQL without its comments (which name ctid, LISTEN and locks to explain why not)."""
    return re.sub(r"--[^\n]*", "", text)


STATEMENTS = _statements()
RUNTIME = {k: v for k, v in STATEMENTS.items() if k[0] not in MIGRATION_FILES}


def test_the_statement_files_are_read() -> None:
    """The scans below would pass on nothing: they must see the statements they judge."""
    assert len(RUNTIME) > 20
    assert ("keys", "claim_insert") in RUNTIME
    assert ("sweep", "delete_keys") in RUNTIME


def test_every_table_is_declared(conn: psycopg.Connection[Any]) -> None:
    tables = {
        r[0]
        for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            (DEFAULT_SCHEMA,),
        )
    }
    assert tables == set(DISTRIBUTION), (
        "every table of pgonce's schema needs its distribution column (or None for a reference "
        "table) in pgonce.sql.distribution.DISTRIBUTION"
    )


def test_every_unique_key_contains_its_tables_distribution_column(
    conn: psycopg.Connection[Any],
) -> None:
    keys = conn.execute(UNIQUE_KEYS, (DEFAULT_SCHEMA,)).fetchall()
    assert {table for table, _, _ in keys} >= {t for t, c in DISTRIBUTION.items() if c}
    wrong = [
        f"{index} on {table} ({', '.join(columns)}) lacks {DISTRIBUTION[table]}"
        for table, index, columns in keys
        if DISTRIBUTION[table] is not None and DISTRIBUTION[table] not in columns
    ]
    assert not wrong


@pytest.mark.parametrize("table", sorted(t for t, c in DISTRIBUTION.items() if c))
def test_the_distribution_column_is_never_null(conn: psycopg.Connection[Any], table: str) -> None:
    row = conn.execute(COLUMN, (DEFAULT_SCHEMA, table, DISTRIBUTION[table])).fetchone()
    assert row is not None, f"{table} has no column {DISTRIBUTION[table]}"
    assert row[2], f"{table}.{DISTRIBUTION[table]} may be NULL: such a row belongs to no shard"


@pytest.mark.parametrize("tables", WRITTEN_TOGETHER, ids="+".join)
def test_tables_written_together_can_be_co_located(
    conn: psycopg.Connection[Any], tables: tuple[str, ...]
) -> None:
    """Citus co-locates tables whose distribution columns have the same type (a domain is a type
    of its own) and the same collation; a transaction over tables it cannot co-locate spans
    shards."""
    kinds = {
        t: conn.execute(COLUMN, (DEFAULT_SCHEMA, t, DISTRIBUTION[t])).fetchone()[:2]  # type: ignore[index]
        for t in tables
    }
    assert len(set(kinds.values())) == 1, kinds


FORBIDDEN = {
    "a session-level advisory lock": re.compile(r"pg_(try_)?advisory_lock(_shared)?\s*\(", re.I),
    "a transaction-level advisory lock": re.compile(r"pg_(try_)?advisory_xact_lock", re.I),
    "SET (session-wide; SET LOCAL or set_config(..., true) end with the transaction)": re.compile(
        r"(\A|;)\s*SET\s+(?!LOCAL\b)", re.I
    ),
    "LISTEN (belongs on a dedicated direct connection)": re.compile(r"\b(UN)?LISTEN\b", re.I),
    "PREPARE / DEALLOCATE": re.compile(r"(\A|;)\s*(PREPARE|DEALLOCATE)\b", re.I),
    "a temporary table": re.compile(r"\bCREATE\s+(TEMP|TEMPORARY)\b", re.I),
    "a cursor WITH HOLD": re.compile(r"\bWITH\s+HOLD\b", re.I),
}


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_no_runtime_statement_keeps_session_state(what: str) -> None:
    found = [f"{g}.{n}" for (g, n), text in RUNTIME.items() if FORBIDDEN[what].search(text)]
    assert not found, f"{what} in {found}"


def _set_config_calls(text: str) -> list[str]:
    """The argument lists of every set_config(...) call in ``text``."""
    calls = []
    for match in re.finditer(r"set_config\s*\(", text, re.I):
        depth, at = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[at], 0)
            at += 1
        calls.append(text[match.end() : at - 1])
    return calls


def test_every_set_config_ends_with_its_transaction() -> None:
    """set_config(name, value, is_local): only ``true`` keeps a pooled connection clean. The
    schema's functions (claim(), outbox_enqueue(), inbox_store()) run on the same connections."""
    texts = {f"{g}.{n}": t for (g, n), t in STATEMENTS.items()}
    texts["schema.sql"] = _code(pgsql.schema_sql())
    calls = {where: _set_config_calls(text) for where, text in texts.items()}
    assert sum(len(c) for c in calls.values()) >= 4  # the scan sees the calls it judges
    wrong = [
        f"{where}: set_config({args})"
        for where, found in calls.items()
        for args in found
        if not re.search(r",\s*true\s*$", args, re.I)
    ]
    assert not wrong


def test_the_schema_holds_no_advisory_lock_or_listen() -> None:
    schema = _code(pgsql.schema_sql())
    assert not re.search(r"advisory|\bLISTEN\b", schema, re.I)


def test_migrations_serialize_with_a_transaction_scoped_lock_only() -> None:
    """The one advisory lock pgonce takes ends with the migration's transaction, so it cannot
    stay behind on a pooled connection."""
    migrate = [t for (g, _), t in STATEMENTS.items() if g in MIGRATION_FILES]
    assert any("pg_advisory_xact_lock" in t for t in migrate)
    assert not any(FORBIDDEN["a session-level advisory lock"].search(t) for t in migrate)


def test_ctid_is_only_a_faster_twin_of_a_portable_statement() -> None:
    """A statement that uses ctid either reaches its rows by key and only selects the ctid along
    (its last line, the join, does not use it), or is ``<name>_by_ctid``, the faster twin of such
    a statement ``<name>`` (the twins differ in their join only), or only returns the ctid
    (claim_insert)."""
    uses = {k for k, text in STATEMENTS.items() if re.search(r"\bctid\b", text, re.I)}
    assert len(uses) >= 3, "the scan must see the statements that use ctid"
    for group, name in sorted(uses - RETURNS_CTID):
        portable = name.removesuffix("_by_ctid")
        assert (group, portable) in STATEMENTS, f"{group}.{name} has no portable twin"
        join = STATEMENTS[(group, portable)].strip().splitlines()[-1]
        assert "ctid" not in join, f"{group}.{portable} joins on ctid and has no portable twin"


def test_the_completion_by_ctid_only_narrows_the_completion_by_key() -> None:
    portable = pgsql.Queries("keys", DEFAULT_SCHEMA).complete
    narrowed = complete_claimed(DEFAULT_SCHEMA)
    assert b"scope = %(scope)s AND key = %(key)s" in portable
    assert narrowed.startswith(portable)
    assert narrowed[len(portable) :].strip() == b"AND ctid = %(row)s::tid"


def test_a_wrong_ctid_completes_nothing_and_the_portable_completion_completes_the_row(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    """Were the ctid wrong (a row moved on another engine, another shard's address), the
    completion by ctid changes no row, another key's least of all; the completion by key alone
    stores the response."""
    store.commit(conn, store.begin(conn, "tenant-b", "k", bytes(32)), Response(200, (), b"b"))
    claim = store.begin(conn, "tenant-a", "k", bytes(32))
    assert isinstance(claim, Won)
    assert claim.row is not None
    found = conn.execute("SELECT ctid::text FROM pgonce.keys WHERE scope = 'tenant-b'").fetchone()
    assert found is not None
    params = {
        "scope": "tenant-a", "key": "k", "status": 201, "headers": Jsonb([]), "body": b"a",
        "now": None,
    }  # fmt: skip
    wrong = conn.execute(complete_claimed(DEFAULT_SCHEMA), {**params, "row": found[0]})
    assert wrong.rowcount == 0
    right = conn.execute(pgsql.Queries("keys", DEFAULT_SCHEMA).complete, params)
    assert right.rowcount == 1
    conn.commit()
    rows = conn.execute(
        "SELECT scope, response_status, response_body FROM pgonce.keys ORDER BY scope"
    ).fetchall()
    assert rows == [("tenant-a", 201, b"a"), ("tenant-b", 200, b"b")]
