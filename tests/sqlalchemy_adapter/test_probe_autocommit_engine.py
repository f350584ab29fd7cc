"""A second engine in ``binds=`` created with ``isolation_level="AUTOCOMMIT"``: each of its
statements commits at once, apart from the claim, the outbox events and the inbox event that
the session's writes go with. pgonce refuses such a session with a UsageError that names the
setting to change, before the ORM's writes reach that engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from pgonce.contrib.sqlalchemy import once, process_batch
from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.outbox_engines import assert_commit_refused, committed
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox
from tests.sqlalchemy_adapter.test_probe_handler_other_engine import last_error

NAMED = "AUTOCOMMIT"


@pytest.fixture
def autocommit(engine: Engine, dsn: str) -> Iterator[Engine]:
    other = create_engine(sqlalchemy_url(dsn), isolation_level="AUTOCOMMIT")
    yield other
    other.dispose()


def test_an_outbox_event_with_writes_on_an_autocommit_engine_is_refused(
    engine: Engine, autocommit: Engine, dsn: str
) -> None:
    assert_commit_refused(engine, autocommit, dsn, NAMED)


def test_a_once_block_writing_on_an_autocommit_engine_is_refused(
    engine: Engine, autocommit: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: autocommit}) as session:
        with pytest.raises(UsageError, match=NAMED), once(session, "s", "k", bytes(32)):
            session.add(Order(key="k"))
        session.commit()
    assert stored(dsn) == ([], [])


def test_a_handler_writing_on_an_autocommit_engine_is_refused(
    engine: Engine, autocommit: Engine, dsn: str
) -> None:
    deliver(dsn, "e1")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))

    factory = sessionmaker(binds={Order: autocommit})
    assert process_batch(engine, "shop", handle, session_factory=factory, retry=POLICY, now=T0)
    assert inbox(dsn) == {"e1": ("pending", 1)}
    assert NAMED in last_error(dsn, "e1")
    assert committed(dsn)[0] == []
