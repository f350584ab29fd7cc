"""One conformance suite, many adapters: each app behind a real server on a real database.

An adapter is a server command (serving the same endpoints: /payments, /boom, /fail, /cookie,
/block, /health) plus how its test database is made. Adding one is one entry in :data:`ADAPTERS`.
Django's database is cloned from a template that ``manage.py migrate`` built once per session
(pgonce's tables through the app's migration, the payments table through the example's).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.conftest import drop_database, new_database
from tests.http.conftest import FASTAPI, Server, ServerFactory, servers_of

ROOT = Path(__file__).resolve().parents[2]

#: gunicorn with threads, as Django is commonly deployed behind WSGI: requests in parallel (the
#: in-flight and concurrency tests need that), each thread on its own Django connection.
GUNICORN = (
    sys.executable,
    "-m",
    "gunicorn",
    "--bind",
    "fd://{fd}",
    "--worker-class",
    "gthread",
    "--workers",
    "1",
    "--threads",
    "16",
    "--no-control-socket",
    "tests.django.wsgi",
)
#: The Flask example under gunicorn's threads, the same way: pgonce's WSGI middleware on a pool.
FLASK_GUNICORN = (
    sys.executable,
    "-m",
    "gunicorn",
    "--bind",
    "fd://{fd}",
    "--worker-class",
    "gthread",
    "--workers",
    "1",
    "--threads",
    "16",
    "--no-control-socket",
    "tests.flask.app:create_app()",
)
DJANGO_UVICORN = (sys.executable, "-m", "bench.servers", "{fd}", "tests.django.asgi:create_app")
#: FastAPI with SQLAlchemy's async ORM: the middleware on the engine's pool, writes through the
#: request's AsyncSession.
SQLALCHEMY = (
    sys.executable,
    "-m",
    "bench.servers",
    "{fd}",
    "tests.sqlalchemy_adapter.app:create_app",
)


@dataclass(frozen=True)
class Adapter:
    name: str
    argv: tuple[str, ...]
    #: Builds, once per session, the template of the adapter's test databases (None: pgonce's).
    template: Callable[[str, str], str] | None = None
    #: Why a behaviour cannot hold on this adapter, by test name (the test is skipped, saying so).
    unsupported: tuple[tuple[str, str], ...] = ()


def django_template(server_dsn: str, pgonce_template: str) -> str:
    """pgonce's template plus ``manage.py migrate`` of the Django test project, built once."""
    digest = hashlib.sha256(pgonce_template.encode())
    for path in sorted((ROOT / "examples" / "django_payments").rglob("migrations/*.py")):
        digest.update(path.read_bytes())
    for path in sorted((ROOT / "src" / "pgonce" / "contrib" / "django").rglob("migrations/*.py")):
        digest.update(path.read_bytes())
    name = f"pgonce_dj_tpl_{digest.hexdigest()[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_advisory_lock(hashtext('pgonce-test-django-template'))")
        try:
            if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                return name
            building = new_database(server_dsn, pgonce_template)
            subprocess.run(
                [sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
                cwd=ROOT,
                env={
                    **os.environ,
                    "DJANGO_SETTINGS_MODULE": "tests.django.settings",
                    "PGONCE_TEST_HTTP_DSN": make_conninfo(server_dsn, dbname=building),
                    "PYTHONPATH": str(ROOT),
                },
                check=True,
            )
            admin.execute(
                sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                    sql.Identifier(building), sql.Identifier(name)
                )
            )
        finally:
            admin.execute("SELECT pg_advisory_unlock(hashtext('pgonce-test-django-template'))")
    return name


_NO_CHUNKED_BODY = (
    "test_a_chunked_body_over_the_limit_is_413",
    "Django's WSGI handler reads no body without a Content-Length (a chunked upload reaches the "
    "view empty), so there is nothing to count",
)

ADAPTERS = {
    adapter.name: adapter
    for adapter in (
        Adapter("fastapi", FASTAPI),
        Adapter("fastapi-sqlalchemy", SQLALCHEMY),
        Adapter("django-wsgi", GUNICORN, django_template, unsupported=(_NO_CHUNKED_BODY,)),
        Adapter("django-asgi", DJANGO_UVICORN, django_template),
        Adapter("flask-wsgi", FLASK_GUNICORN),
    )
}


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> Adapter:
    chosen = ADAPTERS[request.param]
    reasons = dict(chosen.unsupported)
    if request.node.originalname in reasons:
        pytest.skip(f"{chosen.name}: {reasons[request.node.originalname]}")
    return chosen


@pytest.fixture
def app_dsn(adapter: Adapter, server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh database of this test's own, made for the adapter's app."""
    template = adapter.template(server_dsn, template_db) if adapter.template else template_db
    name = new_database(server_dsn, template)
    try:
        yield make_conninfo(server_dsn, dbname=name)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def make_server(adapter: Adapter, app_dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    """Start the adapter's app with middleware options; every server stops at teardown."""
    with servers_of(app_dsn, tmp_path, adapter.argv) as make:
        yield make


@pytest.fixture
def server(make_server: ServerFactory) -> Server:
    return make_server()


@pytest.fixture
def db(app_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for the test's own reads of the database."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        yield conn
