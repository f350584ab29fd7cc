"""The Flask test app under gunicorn (as in the adapter conformance suite), per test, on a database
of the test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from tests.adapters.conftest import FLASK_GUNICORN
from tests.flask.models import Base
from tests.http.conftest import Server, ServerFactory, servers_of
from tests.keys.helpers import sqlalchemy_url


@pytest.fixture
def make_server(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, FLASK_GUNICORN) as make:
        yield make


@pytest.fixture
def server(make_server: ServerFactory) -> Server:
    return make_server()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for the test's own reads of the database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    """An Engine on the test's database, as Flask-SQLAlchemy makes one, with the model's table."""
    made = create_engine(sqlalchemy_url(dsn), pool_size=2)
    Base.metadata.create_all(made)
    yield made
    made.dispose()
