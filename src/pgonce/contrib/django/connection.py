"""Django's own psycopg 3 connection, the one every pgonce call of this app runs on.

pgonce joins the transaction Django opened (``transaction.atomic()``): it never commits or rolls
back on Django's connection itself. A database alias that is not PostgreSQL on psycopg 3, or whose
``AUTOCOMMIT`` is off, is refused with a :class:`~pgonce.errors.ConfigError` that says what to
change.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionDoesNotExist
from psycopg.pq import TransactionStatus

from pgonce.errors import ConfigError, NotInTransaction, UsageError


def check_backend(using: str = "default") -> None:
    """Raise :class:`ConfigError` unless ``using`` is PostgreSQL through psycopg 3, with
    Django's ``AUTOCOMMIT`` on."""
    wrapper = connections[using]
    if not wrapper.settings_dict.get("AUTOCOMMIT", True):
        # Django's outermost atomic() then neither begins nor commits a transaction: the claim,
        # the view's writes and the stored response would be answered 2xx and never committed.
        raise ConfigError(
            f"pgonce needs Django's autocommit: the database {using!r} has 'AUTOCOMMIT': False, "
            "under which transaction.atomic() never commits, so no claim or write of a request "
            "would ever be committed; remove 'AUTOCOMMIT' from its DATABASES entry"
        )
    if wrapper.vendor != "postgresql":
        raise ConfigError(
            f"pgonce needs PostgreSQL: the database {using!r} uses Django's "
            f"{wrapper.vendor!r} backend; set its ENGINE to 'django.db.backends.postgresql'"
        )
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise ConfigError(
            f"pgonce needs psycopg 3, but Django's database {using!r} runs on psycopg2; "
            "install psycopg 3 ('pip install \"psycopg[binary]\"', which pgonce already depends "
            "on) and uninstall psycopg2: Django prefers psycopg 3 when both are present"
        )


def wrapper_of(using: object) -> BaseDatabaseWrapper:
    """Django's ``connections[using]``; a :class:`~pgonce.errors.UsageError` naming ``using``
    when it is not an alias of ``settings.DATABASES``."""
    try:
        return connections[using]
    except (ConnectionDoesNotExist, TypeError, AttributeError) as error:
        # AttributeError, TypeError: Django's handler looks a non-string up as an attribute.
        known = ", ".join(map(repr, connections.settings))
        raise UsageError(
            f"using={using!r} is not a database alias: pass the name of an entry of "
            f"settings.DATABASES ({known})"
        ) from error


def psycopg_connection(using: str = "default") -> psycopg.Connection[Any]:
    """The psycopg 3 connection under Django's ``connections[using]``, inside ``atomic()``.

    Inside a view of a request the Idempotency-Key middleware claimed, asking for it counts as
    the view's first query (:func:`pgonce.contrib.django.middleware.begin`): whatever is written
    on it commits with the claim, and the answer is stored.

    Raises :class:`NotInTransaction` outside ``transaction.atomic()``: a write there would commit
    on its own, apart from the ORM's.
    """
    wrapper = wrapper_of(using)
    if not wrapper.in_atomic_block:
        raise NotInTransaction(
            "pgonce writes must commit with the ORM's: call this inside "
            f"transaction.atomic(using={using!r})"
        )
    wrapper.ensure_connection()
    conn = wrapper.connection
    if not isinstance(conn, psycopg.Connection):
        check_backend(using)
        raise ConfigError(f"the database {using!r} is not a psycopg 3 connection")
    if conn.info.transaction_status == TransactionStatus.IDLE:
        # atomic() has not sent BEGIN yet (psycopg sends it with the first statement): open the
        # transaction now, so that no pgonce call takes the idle connection for one of its own
        # to commit (``@idempotent(commit=True)``) and commits the caller's block with it.
        conn.execute("SELECT 1")
    # Its statements bypass Django's execute wrappers, the middleware's sign that a view began:
    # a view whose only write is, say, an outbox event must still commit it and store its answer.
    from pgonce.contrib.django.middleware import ClaimedRequest

    for hook in wrapper.execute_wrappers:
        if isinstance(hook, ClaimedRequest) and not hook.began:
            hook.began_in(wrapper)
    return conn
