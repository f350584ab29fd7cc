"""Migrations: they build exactly schema.sql, apply once under concurrency, and are idempotent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgonce import sql as pgsql
from pgonce.errors import SchemaNotMigrated
from pgonce.store.migrate import apply_schema_file, migrate, status

if TYPE_CHECKING:
    from pgonce import KeyStore, Response

ROOT = Path(__file__).resolve().parent.parent

# Every kind of object a migration can create in pgonce's schema, described by PostgreSQL itself.
CATALOG = {
    "columns": """
        SELECT c.relname || '.' || a.attname, format_type(a.atttypid, a.atttypmod) || ' '
               || a.attnotnull::text || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
               || ' ' || coalesce(a.attcollation::regcollation::text, '')
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = %(schema)s AND a.attnum > 0 AND NOT a.attisdropped""",
    "relations": """
        SELECT c.relname, c.relkind::text || ' ' || c.relpersistence::text || ' '
               || coalesce(c.reloptions::text, '')
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = %(schema)s""",
    "constraints": """
        SELECT r.relname || '.' || k.conname, pg_get_constraintdef(k.oid)
          FROM pg_constraint k
          JOIN pg_class r ON r.oid = k.conrelid
          JOIN pg_namespace n ON n.oid = k.connamespace
         WHERE n.nspname = %(schema)s""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(schema)s""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = %(schema)s""",
    "domains": """
        SELECT t.typname || '.' || coalesce(k.conname, ''),
               format_type(t.typbasetype, t.typtypmod) || ' ' || t.typnotnull::text || ' '
               || coalesce(pg_get_constraintdef(k.oid), '') || ' '
               || coalesce(t.typcollation::regcollation::text, '')
          FROM pg_type t
          JOIN pg_namespace n ON n.oid = t.typnamespace
          LEFT JOIN pg_constraint k ON k.contypid = t.oid
         WHERE n.nspname = %(schema)s AND t.typtype = 'd'""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = %(schema)s""",
    "triggers": """
        SELECT c.relname || '.' || t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = %(schema)s AND NOT t.tgisinternal""",
    "comments": """
        SELECT c.relname, obj_description(c.oid, 'pg_class')
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = %(schema)s AND obj_description(c.oid, 'pg_class') IS NOT NULL""",
}


def describe(dsn: str, schema: str) -> dict[str, dict[str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            kind: dict(conn.execute(query, {"schema": schema}).fetchall())
            for kind, query in CATALOG.items()
        }


def test_migrations_and_schema_sql_build_the_same_database(
    empty_dsn: str, dsn: str, server_dsn: str
) -> None:
    # `dsn` was built by the migrations (the test template); `empty_dsn` gets schema.sql.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        apply_schema_file(conn, "pgonce")
    from_migrations = describe(dsn, "pgonce")
    from_schema_file = describe(empty_dsn, "pgonce")
    for kind in CATALOG:
        assert from_schema_file[kind] == from_migrations[kind], f"{kind} differ"
    assert from_migrations["relations"], "the comparison saw no tables at all"


def test_migrate_twice_is_a_no_op(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        first = migrate(conn, "pgonce")
        assert first == [m.version for m in pgsql.migrations()]
        assert migrate(conn, "pgonce") == []
        state = status(conn, "pgonce")
        assert state.up_to_date
        assert state.current == pgsql.migrations()[-1].version


def test_the_schema_name_is_configurable(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, "tenant_idem")
        row = conn.execute("SELECT to_regclass('tenant_idem.keys') IS NOT NULL").fetchone()
        assert row == (True,)
        assert conn.execute("SELECT to_regnamespace('pgonce')").fetchone() == (None,)


def test_concurrent_migrate_processes_apply_each_migration_once(empty_dsn: str) -> None:
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "pgonce", "migrate", "--dsn", empty_dsn],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], outputs
    applied_lines = [
        line for out, _ in outputs for line in out.splitlines() if line.startswith("applied")
    ]
    assert len(applied_lines) == len(pgsql.migrations())
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT version, count(*) FROM pgonce.schema_migrations GROUP BY version"
        ).fetchall()
    assert {v for v, _ in rows} == {m.version for m in pgsql.migrations()}
    assert all(count == 1 for _, count in rows)


def test_an_unmigrated_database_says_so(empty_dsn: str) -> None:
    from pgonce import KeyStore, fingerprint

    with psycopg.connect(empty_dsn) as conn:
        assert status(conn, "pgonce").current == 0
        with pytest.raises(SchemaNotMigrated, match="pgonce migrate"):
            KeyStore().claim(conn, "s", "k", fingerprint("x"))


def test_named_queries_parse() -> None:
    parsed = pgsql.parse_named("-- name: a\nSELECT 1\n\n-- name: b\n-- why\nSELECT 2\n")
    assert parsed == {"a": "SELECT 1", "b": "-- why\nSELECT 2"}
    with pytest.raises(RuntimeError, match="twice"):
        pgsql.parse_named("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")


def test_identifiers_stored_before_the_bytewise_migrations_are_found_after_them(
    empty_dsn: str,
) -> None:
    # 0008 and 0009 rebuild the primary keys of keys, inbox and outbox_aggregates under the "C"
    # collation. What was stored before must be found after: a key replays its own response, a
    # redelivered event is a duplicate, an aggregate's next event counts on its existing row; and
    # identifiers that differ only in bytes (NFC and NFD, case) stay apart.
    from hashlib import sha256

    from pgonce import KeyStore, Response, Won, fingerprint
    from pgonce.core.inbox import Delivery
    from pgonce.store._sync.inbox import InboxStore
    from pgonce.store._sync.outbox import enqueue
    from pgonce.store.migrate import _apply_one

    fp = fingerprint("POST", "/orders", b"{}")
    names = ["\u00e9t\u00e9", "e\u0301te\u0301", "ETE", "ete", "\U0001f511-1", "z", "a"]
    store, inbox = KeyStore(), InboxStore()

    def delivery(name: str) -> Delivery:
        return Delivery(name, name, name.encode(), {}, sha256(name.encode()).digest())

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for m in pgsql.migrations():
            if m.version < 8:
                _apply_one(conn, "pgonce", m.text, m.version, m.name)
        conn.autocommit = False
        for name in names:
            # claim() and complete(): what a client of that schema could call (once()'s claim
            # needs 0013's claim()).
            claim = store.claim(conn, "tenant", name, fp)
            assert isinstance(claim, Won)
            store.complete(conn, claim, Response(201, body=name.encode()))
        assert inbox.store(conn, [delivery(n) for n in names]) == ["stored"] * len(names)
        for name in names:
            enqueue(conn, name, name, "created", {})
        conn.commit()
        conn.autocommit = True
        assert migrate(conn, "pgonce")[:2] == [8, 9]
        conn.autocommit = False
        for name in reversed(names):
            with store.once(conn, "tenant", name, fp) as op:
                assert op.replayed, name
                assert op.response is not None
                assert op.response.body == name.encode()
        assert inbox.store(conn, [delivery(n) for n in names]) == ["duplicate"] * len(names)
        for name in names:
            enqueue(conn, name, name, "updated", {})
        conn.commit()
        counts = conn.execute(
            """SELECT (SELECT count(DISTINCT key) FROM pgonce.keys),
                      (SELECT count(DISTINCT event_id) FROM pgonce.inbox),
                      (SELECT array_agg(DISTINCT events) FROM pgonce.outbox_aggregates),
                      (SELECT count(*) FROM pgonce.outbox_aggregates)"""
        ).fetchone()
        assert counts == (len(names), len(names), [2], len(names))


def assert_replayed_and_stuck(
    conn: psycopg.Connection[Any],
    store: KeyStore,
    fp: bytes,
    responses: dict[str, Response],
    *,
    in_transaction: bool,
) -> None:
    """After a migration: every stored response replays (also through once() in a transaction,
    ``in_transaction``), and the claim "stuck", committed without a response, is in flight and
    reported by the health check."""
    from pgonce import InFlight
    from pgonce.store._sync.health import HealthCheck

    for name, response in responses.items():
        with store.once(conn, "tenant", name, fp, commit=True) as op:
            assert op.replayed, name
            assert op.response == response
        if in_transaction:
            with conn.transaction(), store.once(conn, "tenant", name, fp) as op:
                assert op.replayed, name
                assert op.response == response
    with store.once(conn, "tenant", "stuck", fp, commit=True) as op:
        assert isinstance(op.claim, InFlight)
    report = HealthCheck(targets=["keys"]).check(conn)
    stuck = [f for f in report.findings if f.check == "stuck claims"]
    assert [(f.status, f.value.split(" ")[0]) for f in stuck] == [("fail", "1")]


def test_keys_stored_before_the_hot_completions_migration_replay_after_it(empty_dsn: str) -> None:
    # 0013 sets the key store's and the inbox's fillfactor and gives claim() p_completed. What was
    # stored before it must read the same after it: completed keys replay their own responses
    # byte for byte, a claim committed without a response is still in flight and still stuck.
    from datetime import UTC, datetime, timedelta

    from pgonce import KeyStore, Response, Won, fingerprint
    from pgonce.store.migrate import _apply_one

    fp = fingerprint("POST", "/orders", b"{}")
    store = KeyStore()
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    responses = {
        f"k{i}": Response(201, (("content-type", "application/json"),), b'{"n": %d}' % i)
        for i in range(5)
    }
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for m in pgsql.migrations():
            if m.version < 13:
                _apply_one(conn, "pgonce", m.text, m.version, m.name)
        for name, response in responses.items():
            if name in ("k0", "k1"):  # begin()'s statements: born completed
                claim = store.begin(conn, "tenant", name, fp)
                assert store.commit(conn, claim, response)
            else:
                with conn.transaction():
                    claim = store.claim(conn, "tenant", name, fp)
                    assert isinstance(claim, Won)
                    assert store.complete(conn, claim, response)
        with conn.transaction():
            assert isinstance(store.claim(conn, "tenant", "stuck", fp, now=hour_ago), Won)
        assert migrate(conn, "pgonce") == [m.version for m in pgsql.migrations() if m.version >= 13]
        assert_replayed_and_stuck(conn, store, fp, responses, in_transaction=True)
        # And a new key after it: claimed, completed, replayed.
        with conn.transaction(), store.once(conn, "tenant", "new", fp) as op:
            assert op.won
            op.respond(Response(200, body=b"new"))
        with store.once(conn, "tenant", "new", fp, commit=True) as op:
            assert op.replayed
            assert op.response is not None
            assert op.response.body == b"new"


def test_keys_stored_before_the_one_completion_index_replay_after_it(empty_dsn: str) -> None:
    # 0019 replaces keys_incomplete and keys_completed_by_age with keys_by_completion. Every key
    # stored before it is still there and reads the same: completed keys replay, a claim committed
    # without a response is still in flight and still stuck, and the sweeper finds the keys due.
    from datetime import UTC, datetime, timedelta

    from pgonce import KeyStore, Response, Won, fingerprint
    from pgonce.core.retention import SweepLimits
    from pgonce.store._sync.sweeper import Sweeper
    from pgonce.store.migrate import _apply_one

    fp = fingerprint("POST", "/orders", b"{}")
    store = KeyStore()
    now, day = datetime.now(UTC), timedelta(days=1)
    responses = {f"k{i}": Response(201, body=b'{"n": %d}' % i) for i in range(6)}
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for m in pgsql.migrations():
            if m.version < 19:
                _apply_one(conn, "pgonce", m.text, m.version, m.name)
        for name, response in responses.items():
            if name in ("k0", "k1"):  # begin()'s statements
                assert store.commit(conn, store.begin(conn, "tenant", name, fp), response)
            elif name in ("k2", "k3"):  # once() in the caller's transaction
                with conn.transaction(), store.once(conn, "tenant", name, fp) as op:
                    op.respond(response)
            else:  # a bare claim() and its completion
                with conn.transaction():
                    claim = store.claim(conn, "tenant", name, fp)
                    assert isinstance(claim, Won)
                    assert store.complete(conn, claim, response)
        with conn.transaction():
            assert isinstance(store.claim(conn, "tenant", "stuck", fp, now=now - day), Won)
        with conn.transaction():  # due for the sweeper: completed 40 days ago
            claim = store.claim(conn, "tenant", "old", fp, now=now - 40 * day)
            assert isinstance(claim, Won)
            assert store.complete(conn, claim, Response(200), now=now - 40 * day)
        before = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
        assert migrate(conn, "pgonce") == [m.version for m in pgsql.migrations() if m.version >= 19]
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == before
        assert_replayed_and_stuck(conn, store, fp, responses, in_transaction=False)
        swept = Sweeper(targets=["keys"], limits=SweepLimits(pause=timedelta(0))).sweep(conn)
        assert swept.deleted == 1
        assert conn.execute("SELECT count(*) FROM pgonce.keys WHERE key = 'old'").fetchone() == (0,)
