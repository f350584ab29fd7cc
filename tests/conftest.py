"""Fixtures on real PostgreSQL; nothing here mocks the database.

``PGONCE_TEST_DSN`` selects an existing server (CI uses the machine's PostgreSQL 15). Without it the
suite starts the embedded PostgreSQL 18 once, in the controlling process, with its data in
``.pgonce/test-data``, and hands its DSN to the xdist workers.

Each test that asks for ``dsn`` gets a database of its own, cloned from a template that was migrated
once per schema version; tests therefore run in parallel (``pytest -n auto``) and never see each
other's rows.

A test marked ``pooled`` runs twice: directly (``route=direct``) and through the suite's own
PgBouncer in transaction mode (``route=pgbouncer``, see tests/pgbouncer.py), where ``dsn`` goes
through the pooler and ``conn``/``aconn``/``connect_kwargs`` carry ``prepare_threshold=None``, as
the production guide requires behind PgBouncer before 1.21.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce import sql as pgsql
from pgonce.database import embedded_server
from pgonce.store import wire
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._sync.keys import KeyStore
from pgonce.store.migrate import migrate
from tests import logscan
from tests.pgbouncer import running_pgbouncer

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "pgonce"
_embedded: contextlib.ExitStack | None = None


def _tune_test_server(dsn: str) -> bool:
    """Settings for a disposable server; True when a restart is needed to apply them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        current = conn.execute("SHOW max_connections").fetchone()
        if current and int(current[0]) >= 300:
            return False
        conn.execute("ALTER SYSTEM SET max_connections = 300")
        conn.execute("ALTER SYSTEM SET fsync = off")
        conn.execute("ALTER SYSTEM SET synchronous_commit = off")
        conn.execute("ALTER SYSTEM SET full_page_writes = off")
        return True


def pytest_configure(config: pytest.Config) -> None:
    global _embedded
    logscan.configure(config)
    if os.environ.get("PGONCE_TEST_DSN") or hasattr(config, "workerinput"):
        return
    data_dir = ROOT / ".pgonce" / "test-data"
    for _ in range(2):
        _embedded = contextlib.ExitStack()
        dsn = _embedded.enter_context(embedded_server(data_dir))
        if not _tune_test_server(dsn):
            break
        _embedded.close()
    os.environ["PGONCE_TEST_DSN"] = dsn


def pytest_sessionfinish(session: pytest.Session) -> None:
    logscan.finish(session)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _embedded is not None:
        _embedded.close()


def pytest_report_header(config: pytest.Config) -> str:
    dsn = os.environ.get("PGONCE_TEST_DSN", "")
    where = (
        f" (embedded, data in {ROOT / '.pgonce' / 'test-data'}: no PGONCE_TEST_DSN given)"
        if _embedded is not None
        else ""
    )
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return f"pgonce: PostgreSQL {row[0] if row else '?'}{where}"
    except psycopg.Error as error:
        return f"pgonce: PostgreSQL not reachable: {error}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("pooled") is not None:
        metafunc.parametrize("route", ["direct", "pgbouncer"], indirect=True)


@pytest.fixture
def route(request: pytest.FixtureRequest) -> str:
    """How the test reaches the server: "direct", or "pgbouncer" for a ``pooled`` test's variant."""
    return str(getattr(request, "param", "direct"))


@pytest.fixture(scope="session")
def pgbouncer_server_dsn(server_dsn: str) -> Iterator[str]:
    """The test server through this process's PgBouncer (transaction mode), started once."""
    with running_pgbouncer(server_dsn) as pooled:
        yield pooled


@pytest.fixture
def connect_kwargs(route: str) -> dict[str, Any]:
    """psycopg's connection arguments for the route: no prepared statements through PgBouncer."""
    return {"prepare_threshold": None} if route == "pgbouncer" else {}


@pytest.fixture(autouse=True)
def _named_statements_again() -> Iterator[None]:
    """A test that meets a pooler switches the process to unnamed statements; the next test
    starts with named ones again."""
    yield
    wire._reset_naming()


@pytest.fixture(scope="session")
def server_dsn() -> str:
    """DSN of the test server's maintenance database (used to create and drop test databases)."""
    return os.environ["PGONCE_TEST_DSN"]


def _schema_hash() -> str:
    digest = hashlib.sha256(pgsql.schema_sql().encode())
    for migration in pgsql.migrations():
        digest.update(migration.text.encode())
    return digest.hexdigest()[:12]


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> str:
    """A database migrated to the current schema; created once, by whichever worker comes first."""
    name = f"pgonce_tpl_{_schema_hash()}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        # A session lock is fine here: this is the test harness, not pgonce's runtime.
        admin.execute("SELECT pg_advisory_lock(hashtext('pgonce-test-template'))")
        try:
            exists = admin.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                building = f"{name}_build_{os.getpid()}"
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(building)))
                with psycopg.connect(
                    make_conninfo(server_dsn, dbname=building), autocommit=True
                ) as c:
                    migrate(c, SCHEMA)
                admin.execute(
                    sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                        sql.Identifier(building), sql.Identifier(name)
                    )
                )
        finally:
            admin.execute("SELECT pg_advisory_unlock(hashtext('pgonce-test-template'))")
    return name


def new_database(server_dsn: str, template: str) -> str:
    name = f"pgonce_t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    return name


def drop_database(server_dsn: str, name: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def direct_dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own, reached directly whatever the route."""
    name = new_database(server_dsn, template_db)
    try:
        yield make_conninfo(server_dsn, dbname=name)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def dsn(direct_dsn: str, route: str, request: pytest.FixtureRequest) -> str:
    """A fresh, migrated database of this test's own (through PgBouncer on that route)."""
    if route != "pgbouncer":
        return direct_dsn
    pooled: str = request.getfixturevalue("pgbouncer_server_dsn")
    return make_conninfo(pooled, dbname=conninfo_to_dict(direct_dsn)["dbname"])


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A fresh database with nothing of pgonce in it (for migration tests)."""
    name = new_database(server_dsn, "template0")
    try:
        yield make_conninfo(server_dsn, dbname=name)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def conn(dsn: str, connect_kwargs: dict[str, Any]) -> Iterator[psycopg.Connection[Any]]:
    """A sync connection to the test's database, not in autocommit (psycopg's default)."""
    with psycopg.connect(dsn, **connect_kwargs) as c:
        yield c


@pytest.fixture
async def aconn(
    dsn: str, connect_kwargs: dict[str, Any]
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(dsn, **connect_kwargs) as c:
        yield c


@pytest.fixture
def store() -> KeyStore:
    return KeyStore(schema=SCHEMA)


@pytest.fixture
def astore() -> AsyncKeyStore:
    return AsyncKeyStore(schema=SCHEMA)
