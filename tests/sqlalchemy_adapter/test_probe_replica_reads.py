"""Reads through a second engine in ``binds=`` (a replica) inside a once() block, as the how-to
says them: an engine without ``isolation_level="AUTOCOMMIT"`` joins the session's transaction,
and its reads are fine; an AUTOCOMMIT engine is refused as soon as the session's transaction
joins it, even for a read (pgonce cannot tell a statement that writes before it runs, and every
statement there commits at once), the block rolled back and the key free; a session of its own
on the AUTOCOMMIT engine reads beside the block.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.orm import Session

from pgonce import Response
from pgonce.contrib.sqlalchemy import once
from pgonce.errors import UsageError
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order


def replica_engine(engine: Engine, dsn: str, **options: str) -> Iterator[Engine]:
    """The engine the reads go to (the test's own database stands for a replica)."""
    with Session(engine) as session, session.begin():
        session.add(Order(key="read"))
    replica = create_engine(sqlalchemy_url(dsn), **options)
    yield replica
    replica.dispose()


@pytest.fixture
def replica(engine: Engine, dsn: str) -> Iterator[Engine]:
    yield from replica_engine(engine, dsn)


@pytest.fixture
def autocommit_replica(engine: Engine, dsn: str) -> Iterator[Engine]:
    yield from replica_engine(engine, dsn, isolation_level="AUTOCOMMIT")


def read(session: Session) -> list[str]:
    return list(session.scalars(select(Order.key)))


def test_a_read_through_a_replica_engine_in_binds_is_fine(
    engine: Engine, replica: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: replica}) as session:
        with once(session, "s", "k", bytes(32)) as op:
            assert read(session) == ["read"]
            op.respond(Response(200))
        session.commit()
    assert stored(dsn) == (["read"], [("k", 200)])


def test_a_read_through_an_autocommit_engine_in_binds_is_refused(
    engine: Engine, autocommit_replica: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: autocommit_replica}) as session:
        with (
            pytest.raises(UsageError, match="a read there is refused too"),
            once(session, "s", "k", bytes(32)) as op,
        ):
            read(session)
            op.respond(Response(200))
        session.rollback()
    assert stored(dsn) == (["read"], [])


def test_a_session_of_its_own_reads_an_autocommit_engine_beside_the_block(
    engine: Engine, autocommit_replica: Engine, dsn: str
) -> None:
    with Session(engine) as session, Session(autocommit_replica) as reads:
        with once(session, "s", "k", bytes(32)) as op:
            assert read(reads) == ["read"]
            op.respond(Response(200))
        session.commit()
    assert stored(dsn) == (["read"], [("k", 200)])


def test_an_autocommit_engine_read_before_the_block_is_refused_at_once(
    engine: Engine, autocommit_replica: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: autocommit_replica}) as session:
        assert read(session) == ["read"]  # joined before pgonce is called: nothing to refuse
        with pytest.raises(UsageError, match="AUTOCOMMIT"), once(session, "s", "k", bytes(32)):
            pass
        session.rollback()
    assert stored(dsn) == (["read"], [])
