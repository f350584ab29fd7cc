"""once() under the session set-ups teams use: autobegin, a test's external transaction, a
pool with pre-ping over a killed backend, and a rollback or close of the session inside the
block. Each ends with the key either stored with its writes or free, never in flight. Real
sessions on a real PostgreSQL, counted from another connection.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import once
from pgonce.errors import UsageError
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")


def place(session: Session, key: str) -> bool:
    """One request's block; True when it ran the work."""
    with once(session, "t", key, FP) as op:
        if op.won:
            session.add(Order(key=key))
            op.respond(CREATED)
    assert op.response == CREATED
    return op.won


def test_an_autobegun_session_commits_the_block_with_its_commit(dsn: str, engine: Engine) -> None:
    with Session(engine) as session:
        assert place(session, "k")
        assert stored(dsn) == ([], [])  # nothing before the session's commit
        session.commit()
        assert not place(session, "k")  # the replay, in the next autobegun transaction
        session.commit()
    assert stored(dsn) == (["k"], [("k", 201)])


def test_the_join_an_external_transaction_recipe_rolls_everything_back(
    dsn: str, engine: Engine
) -> None:
    with engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        assert place(session, "k")
        session.commit()  # releases the session's savepoint only
        assert not place(session, "k")  # the replay sees the claim in the outer transaction
        session.close()
        outer.rollback()
    assert stored(dsn) == ([], [])


def test_a_pre_pinged_pool_replays_after_its_backend_was_killed(dsn: str, engine: Engine) -> None:
    pinged = create_engine(sqlalchemy_url(dsn), pool_pre_ping=True, pool_size=1)
    try:
        with Session(pinged) as session, session.begin():
            assert place(session, "k")
            pid = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with Session(pinged) as session, session.begin():
            assert not place(session, "k")
    finally:
        pinged.dispose()
    assert stored(dsn) == (["k"], [("k", 201)])


@pytest.mark.parametrize("end", ["rollback", "close"])
def test_a_session_ended_inside_the_block_leaves_the_key_free(
    dsn: str, engine: Engine, end: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(UsageError, match="the key is free"), once(session, "t", "k", FP) as op:
            session.add(Order(key="k"))
            session.flush()
            getattr(session, end)()
            op.respond(CREATED)
        session.rollback()
        assert stored(dsn) == ([], [])
        assert place(session, "k")  # the retry runs the work
        session.commit()
    assert stored(dsn) == (["k"], [("k", 201)])
