"""Applying pgonce's schema on a Django database: the migration and ``pgonce_migrate`` share this.

pgonce's own migrator (:func:`pgonce.store.migrate.migrate`) does the work on a psycopg
connection of its own, opened from the alias's settings: it commits each numbered migration with
its ledger row under an advisory lock, which is not something to run inside the transaction Django
holds for its own migration. Applying twice applies nothing the second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connections

from pgonce.contrib.django.connection import check_backend
from pgonce.store.migrate import migrate


def connect_like(using: str) -> psycopg.Connection[Any]:
    """A new autocommit psycopg connection to the database behind the alias ``using``."""
    check_backend(using)
    params = connections[using].get_connection_params()
    # Django's own extras (its cursor class, its loaders' context) stay on Django's connections.
    for name in ("cursor_factory", "context", "server_side_binding", "prepare_threshold"):
        params.pop(name, None)
    return psycopg.connect(**params, autocommit=True)


def apply_schema(
    using: str, schema: str, on_applied: Callable[[int, str], None] | None = None
) -> list[int]:
    """Apply pgonce's pending migrations to ``using``; the versions applied."""
    with connect_like(using) as conn:
        return migrate(conn, schema, on_applied=on_applied)
